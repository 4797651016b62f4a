"""What this process may really use of the machine: CPUs (its affinity mask and its cgroup's CPU
quota) and memory (the host's available memory and its cgroup's memory limit).

A container sees the host's cores and memory in `os.cpu_count()` and /proc/meminfo; what it may use
is set by its cgroup: a Kubernetes CPU limit is a CFS quota (cgroup v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`), a memory limit is `memory.max` (v1
`memory.limit_in_bytes`). The process's cgroup is found from /proc/self/cgroup and
/proc/self/mountinfo, as Go's runtime and the JVM find it, and a limit set on any cgroup above it
counts too (the smallest wins). Torch-free: cli.py reads it before torch is imported.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712); anything
# this big is no limit.
_NO_LIMIT = 2**60

# libgomp (torch's OpenMP runtime, which braid's kernels share) spins this many times in a barrier
# before it sleeps on a futex. Its own default, 300,000 (about 4 ms here), is what collapses decode
# beside a busy neighbour: a thread that has no core holds the others spinning at every parallel
# region, some 150 a token. 10,000 keeps the quiet speed and bounds the waste; benchmarks/neighbours.py
# measures it (docs/benchmarks.md, "Sharing the cores"). Read once, when libgomp loads with torch.
SPIN_COUNT = 10_000


@dataclass(frozen=True)
class Threads:
    """How many threads the CPU pools get, and why."""

    count: int
    reason: str


@dataclass(frozen=True)
class Memory:
    """Bytes this process may still take, and where the figure comes from."""

    available: int
    reason: str


def threads(requested: int = 0, proc: Path = Path("/proc")) -> Threads:
    """`requested` (--threads) if positive; else the CPUs the process may use: its affinity mask,
    cut by its cgroup's CPU quota rounded down, at least 1. A quota of 1.5 CPUs gets 1 thread: a
    second would find the quota spent every period and stall the first at each barrier."""
    if requested > 0:
        return Threads(requested, "--threads")
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota(proc)
    if quota is None or quota >= affinity:
        why = f"affinity: {affinity} CPUs" + ("" if quota is None else f"; cgroup CPU quota {quota:g}")
        return Threads(affinity, why)
    return Threads(max(1, math.floor(quota)), f"cgroup CPU quota {quota:g} CPUs, rounded down; affinity {affinity}")


def cpu_quota(proc: Path = Path("/proc")) -> float | None:
    """The CPUs the process's cgroup quota allows (quota / period, the smallest on its path), or
    None where no cgroup sets one."""
    quotas = []
    for directory in _cgroup_dirs("cpu", proc):
        v2 = _read(directory / "cpu.max")
        if v2 is not None:
            quota, _, period = v2.partition(" ")
            if quota != "max":
                quotas.append(int(quota) / int(period or 100_000))
        v1 = _read(directory / "cpu.cfs_quota_us")
        if v1 is not None and int(v1) > 0:
            quotas.append(int(v1) / int(_read(directory / "cpu.cfs_period_us") or 100_000))
    return min(quotas, default=None)


def memory_limit(proc: Path = Path("/proc")) -> tuple[int, int] | None:
    """The smallest memory limit on the process's cgroup path and what that cgroup holds now, its
    working set (usage less inactive file pages, which the kernel reclaims before it kills: what
    the kubelet counts), or None where no cgroup sets one."""
    found: tuple[int, int] | None = None
    for directory in _cgroup_dirs("memory", proc):
        for limit_file, usage_file, inactive_key in (
            ("memory.max", "memory.current", "inactive_file"),
            ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
        ):
            text = _read(directory / limit_file)
            if text is None or text == "max" or int(text) >= _NO_LIMIT:
                continue
            limit = int(text)
            if found is None or limit < found[0]:
                usage = int(_read(directory / usage_file) or 0)
                inactive = _stat(directory / "memory.stat").get(inactive_key, 0)
                found = (limit, max(0, usage - inactive))
    return found


def available_memory(proc: Path = Path("/proc")) -> Memory:
    """Bytes the process may still take: the host's available memory, or what is left under its
    cgroup's memory limit where that is less."""
    host = _meminfo_available(proc)
    limited = memory_limit(proc)
    if limited is not None and limited[0] - limited[1] < host:
        limit, used = limited
        return Memory(limit - used, f"cgroup memory limit {limit / 2**20:.0f} MiB, {used / 2**20:.0f} MiB of it in use")
    return Memory(
        host,
        "the host's available memory"
        + ("" if limited is None else f" (under the cgroup limit {limited[0] / 2**20:.0f} MiB)"),
    )


def bound_spinning(environ: MutableMapping[str, str] = os.environ) -> str:
    """Sets GOMP_SPINCOUNT (SPIN_COUNT) unless the user has set it or OMP_WAIT_POLICY; must run
    before torch loads libgomp. Returns what is in force, for the log."""
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        if name in environ:
            return f"{name}={environ[name]} (from the environment)"
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return f"GOMP_SPINCOUNT={SPIN_COUNT}"


def release_freed_heap() -> bool:
    """Hands the pages that glibc's heaps hold free back to the system (malloc_trim: every arena's,
    not only the top of the main one). glibc keeps what a program frees for its next allocations:
    its mmap threshold rises to the largest chunk freed, so later big buffers come from the heap and
    stay resident once freed. False where the C library has no malloc_trim (not glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def huge_page_size(sys_dir: Path = Path("/sys")) -> int:
    """The size of the kernel's transparent huge pages (a PMD's: 2 MiB on x86-64), or 0 where it has none."""
    text = _read(sys_dir / "kernel/mm/transparent_hugepage/hpage_pmd_size")
    return int(text) if text and text.isdigit() else 0


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _cgroup_dirs(controller: str, proc: Path) -> Iterator[Path]:
    """The directories of the process's cgroups that `controller` governs (v1, and v2 where
    mounted), each from the process's own up to its hierarchy's root."""
    mounts = []  # (root within the hierarchy, mount point, version)
    for line in _lines(proc / "self/mountinfo"):
        fields, _, after = line.partition(" - ")
        parts, tail = fields.split(), after.split()
        if len(parts) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            mounts.append((parts[3], Path(_unescape(parts[4])), 2))
        elif tail[0] == "cgroup" and controller in tail[2].split(","):
            mounts.append((parts[3], Path(_unescape(parts[4])), 1))
    for line in _lines(proc / "self/cgroup"):
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        version = 2 if hierarchy == "0" and not controllers else 1
        if version == 1 and controller not in controllers.split(","):
            continue
        for root, mount_point, mount_version in mounts:
            if mount_version != version:
                continue
            # Without a cgroup namespace the path is the host's, and the container's mount holds
            # only its own part of the hierarchy: the path below the mount's root.
            inner = path[len(root) :] if root != "/" and (path + "/").startswith(root + "/") else path
            directory = mount_point / inner.lstrip("/")
            if not directory.is_dir():
                directory = mount_point
            while True:
                yield directory
                if directory == mount_point or mount_point not in directory.parents:
                    break
                directory = directory.parent


def _meminfo_available(proc: Path) -> int:
    for line in _lines(proc / "meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _stat(path: Path) -> dict[str, int]:
    pairs = (line.split() for line in _lines(path))
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def _lines(path: Path) -> list[str]:
    text = _read(path)
    return text.splitlines() if text else []


def _unescape(field: str) -> str:
    """mountinfo writes a space in a path as \\040 (and tab, newline, backslash alike)."""
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
