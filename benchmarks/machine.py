"""The machine and software a run used, and how much of the CPU other processes took meanwhile."""

from __future__ import annotations

import asyncio
import hashlib
import os
import platform
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from braid.server.engine.engine import RELEASE_AFTER_IDLE_S

REPO = Path(__file__).resolve().parent.parent
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class MachineInfo:
    cpu_model: str
    cores: int
    memory_gb: float
    os: str
    threads: int
    python: str
    torch: str
    transformers: str
    grpcio: str
    braid_commit: str
    llama_cpp: str = "absent"

    def as_dict(self) -> dict:
        return asdict(self)


def describe(threads: int) -> MachineInfo:
    return MachineInfo(
        cpu_model=_cpu_model(),
        cores=os.cpu_count() or 0,
        memory_gb=_memory_gb(),
        os=platform.platform(terse=True),
        threads=threads,
        python=platform.python_version(),
        torch=_version("torch"),
        transformers=_version("transformers"),
        grpcio=_version("grpcio"),
        braid_commit=braid_commit(),
    )


def braid_commit() -> str:
    """HEAD's short hash, plus a hash of the uncommitted changes to server/ if there are any."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    diff = git("diff", "HEAD", "--", "server")
    return f"{head}+dirty:{hashlib.sha256(diff.encode()).hexdigest()[:8]}" if diff else head


def _cpu_model() -> str:
    """The model name and the vector extensions that matter for fp32 matmuls."""
    info = Path("/proc/cpuinfo").read_text().splitlines()
    name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.processor())
    flags = set(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
    extensions = [
        label for flag, label in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("amx_tile", "AMX")) if flag in flags
    ]
    return f"{name or 'unknown'} ({', '.join(extensions)})" if extensions else name or "unknown"


def vector_isa() -> str:
    """The vector extensions the CPU kernels care about, those it has and those it lacks:
    "AVX2, FMA, F16C; no AVX-512, no AMX"."""
    info = Path("/proc/cpuinfo").read_text().splitlines()
    flags = set(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
    wanted = (
        ("avx2", "AVX2"),
        ("fma", "FMA"),
        ("f16c", "F16C"),
        ("avx512f", "AVX-512"),
        ("avx512_bf16", "AVX-512 BF16"),
        ("avx512_vnni", "AVX-512 VNNI"),
        ("amx_tile", "AMX"),
    )
    present = [label for flag, label in wanted if flag in flags]
    absent = [f"no {label}" for flag, label in wanted if flag not in flags and "AVX-512 " not in label]
    return "; ".join(part for part in (", ".join(present), ", ".join(absent)) if part)


def _memory_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return 0.0


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def read_bandwidth_gbs(threads: int, size_mib: int = 512, rounds: int = 5) -> float:
    """Memory read bandwidth in GB/s: `threads` threads each sum their own part of a `size_mib` MiB
    array (numpy releases the GIL in the sum); the best of `rounds`. What a decode step, which reads
    every weight once, can hope for at best."""
    import numpy as np

    parts = [np.ones(size_mib * 2**20 // 8 // threads, dtype=np.int64) for _ in range(threads)]
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))  # touch the pages once
        for _ in range(rounds):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, sum(p.nbytes for p in parts) / (time.perf_counter() - start) / 1e9)
    return best


def rss_mib(pid: int) -> float:
    """The resident memory of a process (VmRSS: anonymous memory and the mapped file pages it has touched)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# A served braid hands its freed heap back to the system once its model has been idle for
# RELEASE_AFTER_IDLE_S (a malloc_trim): resident memory "at rest" is read a second after that, for
# every server measured alike, so that a read right after the warm-up's last request does not count
# what braid gives back a second later (25-58 MiB at the 1B shape).
AT_REST_S = RELEASE_AFTER_IDLE_S + 1.0


async def rss_at_rest_mib(pid: int) -> float:
    """rss_mib once the process has been idle AT_REST_S: the warm-up done, before the workloads."""
    await asyncio.sleep(AT_REST_S)
    return rss_mib(pid)


class CpuMeter:
    """Cores used by processes other than `pids` (and this one) between start() and stop(): the
    benchmark shares its 2 cores with whoever else runs on the machine."""

    def __init__(self, pids: list[int] | None = None) -> None:
        self._pids = [os.getpid(), *(pids or [])]

    def start(self) -> None:
        self._t0, self._busy0, self._own0 = time.monotonic(), _busy_seconds(), self._own_seconds()

    def stop(self) -> float:
        elapsed = time.monotonic() - self._t0
        other = (_busy_seconds() - self._busy0) - (self._own_seconds() - self._own0)
        return max(other, 0.0) / elapsed if elapsed > 0 else 0.0

    def _own_seconds(self) -> float:
        return sum(_process_seconds(pid) for pid in self._pids)


def wait_until_quiet(pids: list[int], *, threshold: float, max_wait_s: float, sample_s: float = 1.0) -> float:
    """Waits (at most max_wait_s) until other processes use at most `threshold` cores over a sample;
    returns the last sample."""
    deadline = time.monotonic() + max_wait_s
    while True:
        meter = CpuMeter(pids)
        meter.start()
        time.sleep(sample_s)
        other = meter.stop()
        if other <= threshold or time.monotonic() >= deadline:
            return other


def _busy_seconds() -> float:
    """CPU time spent by the whole machine, all cores, since boot (everything but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / _CLOCK_TICKS


def _process_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads, and of its waited-for children."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / _CLOCK_TICKS
