"""What the process may use of the machine: the affinity mask and the cgroup's CPU quota, the cgroup's
memory limit; read from fake /proc and cgroup trees, v1 and v2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from braid.server import resources


GiB, MiB = 2**30, 2**20
V1_NO_LIMIT = "9223372036854771712"


class Host:
    """A fake /proc/self/{cgroup,mountinfo}, /proc/meminfo and cgroup hierarchies under tmp_path."""

    def __init__(self, root: Path, available_kb: int = 20 * GiB // 1024) -> None:
        self.root = root
        self.proc = root / "proc"
        (self.proc / "self").mkdir(parents=True)
        (self.proc / "meminfo").write_text(f"MemTotal: {2 * available_kb} kB\nMemAvailable: {available_kb} kB\n")
        self.mounts: list[str] = []
        self.groups: list[str] = []

    def v2(self, path: str = "/", mount_root: str = "/") -> Path:
        """The unified hierarchy, mounted at sys/fs/cgroup; the process in `path`. Returns its directory."""
        mount = self.root / "sys/fs/cgroup"
        self.mounts.append(f"30 20 0:26 {mount_root} {mount} rw,nosuid - cgroup2 cgroup2 rw")
        self.groups.append(f"0::{path}")
        return self._dir(mount, path, mount_root)

    def v1(self, controller: str, path: str = "/", mount_root: str = "/") -> Path:
        mount = self.root / f"sys/fs/cgroup/{controller}"
        self.mounts.append(
            f"3{len(self.mounts)} 20 0:3{len(self.mounts)} {mount_root} {mount} rw - cgroup cgroup rw,{controller}"
        )
        self.groups.append(f"{len(self.groups) + 2}:{controller}:{path}")
        return self._dir(mount, path, mount_root)

    def _dir(self, mount: Path, path: str, mount_root: str) -> Path:
        inner = path[len(mount_root) :] if mount_root != "/" else path
        directory = mount / inner.lstrip("/")
        directory.mkdir(parents=True, exist_ok=True)
        (self.proc / "self/mountinfo").write_text("\n".join(self.mounts) + "\n")
        (self.proc / "self/cgroup").write_text("\n".join(self.groups) + "\n")
        return directory


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Host:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    return Host(tmp_path)


def test_no_cgroup_files_means_the_affinity_mask(host: Host) -> None:
    assert resources.cpu_quota(host.proc) is None
    assert resources.threads(0, host.proc) == resources.Threads(4, "affinity: 4 CPUs")


@pytest.mark.parametrize(("cpu_max", "expected"), [
    ("150000 100000", 1),  # 1.5 CPUs: rounded down
    ("50000 100000", 1),  # half a CPU: at least 1
    ("200000 100000", 2),
    ("250000 50000", 4),  # 5 CPUs of quota, 4 in the mask
    ("max 100000", 4),
])  # fmt: skip
def test_a_v2_quota_cuts_the_threads(host: Host, cpu_max: str, expected: int) -> None:
    (host.v2("/kubepods/pod1/braid") / "cpu.max").write_text(cpu_max + "\n")
    threads = resources.threads(0, host.proc)
    assert threads.count == expected
    if expected < 4:
        assert "cgroup CPU quota" in threads.reason


def test_a_v1_quota_cuts_the_threads(host: Host) -> None:
    group = host.v1("cpu,cpuacct", "/docker/abc")
    (group / "cpu.cfs_quota_us").write_text("150000\n")
    (group / "cpu.cfs_period_us").write_text("100000\n")
    assert resources.cpu_quota(host.proc) == 1.5
    assert resources.threads(0, host.proc).count == 1


def test_a_v1_quota_of_minus_one_is_none(host: Host) -> None:
    group = host.v1("cpu", "/")
    (group / "cpu.cfs_quota_us").write_text("-1\n")
    (group / "cpu.cfs_period_us").write_text("100000\n")
    assert resources.cpu_quota(host.proc) is None
    assert resources.threads(0, host.proc).count == 4


def test_a_quota_on_a_parent_cgroup_counts(host: Host) -> None:
    group = host.v2("/kubepods/pod1/braid")
    (group / "cpu.max").write_text("max 100000")
    (group.parent / "cpu.max").write_text("100000 100000")  # the pod's limit: 1 CPU
    assert resources.threads(0, host.proc).count == 1


def test_a_container_without_a_cgroup_namespace_reads_its_own_mount(host: Host) -> None:
    # /proc/self/cgroup names the host's path; the container's mount holds only its own cgroup.
    group = host.v2("/kubepods/pod1/braid", mount_root="/kubepods/pod1/braid")
    assert group == host.root / "sys/fs/cgroup"
    (group / "cpu.max").write_text("200000 100000")
    assert resources.threads(0, host.proc).count == 2


def test_threads_flag_wins(host: Host) -> None:
    (host.v2() / "cpu.max").write_text("50000 100000")
    assert resources.threads(3, host.proc) == resources.Threads(3, "--threads")


def test_no_memory_limit_means_the_hosts_available_memory(host: Host) -> None:
    (host.v1("memory", "/process_api/x") / "memory.limit_in_bytes").write_text(V1_NO_LIMIT)
    (host.v2() / "memory.max").write_text("max\n")
    assert resources.memory_limit(host.proc) is None
    memory = resources.available_memory(host.proc)
    assert memory.available == 20 * GiB and memory.reason == "the host's available memory"


def test_a_v2_memory_limit_less_its_working_set(host: Host) -> None:
    group = host.v2("/kubepods/pod1/braid")
    (group / "memory.max").write_text(str(2 * GiB))
    (group / "memory.current").write_text(str(700 * MiB))
    (group / "memory.stat").write_text(f"anon {500 * MiB}\ninactive_file {200 * MiB}\nactive_file 0\n")
    assert resources.memory_limit(host.proc) == (2 * GiB, 500 * MiB)
    memory = resources.available_memory(host.proc)
    assert memory.available == 2 * GiB - 500 * MiB
    assert memory.reason == "cgroup memory limit 2048 MiB, 500 MiB of it in use"


def test_a_v1_memory_limit_on_a_parent(host: Host) -> None:
    group = host.v1("memory", "/kubepods/pod1/braid")
    (group / "memory.limit_in_bytes").write_text(V1_NO_LIMIT)
    (group.parent / "memory.limit_in_bytes").write_text(str(3 * GiB))
    (group.parent / "memory.usage_in_bytes").write_text(str(GiB))
    (group.parent / "memory.stat").write_text(f"cache {GiB // 2}\ntotal_inactive_file {GiB // 2}\n")
    assert resources.available_memory(host.proc).available == 3 * GiB - GiB // 2


def test_a_limit_above_the_hosts_free_memory_leaves_the_host_figure(host: Host) -> None:
    (host.v2() / "memory.max").write_text(str(64 * GiB))
    memory = resources.available_memory(host.proc)
    assert memory.available == 20 * GiB and "under the cgroup limit 65536 MiB" in memory.reason


def test_spinning_is_bounded_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    env: dict[str, str] = {}
    assert resources.bound_spinning(env) == f"GOMP_SPINCOUNT={resources.SPIN_COUNT}"
    assert env == {"GOMP_SPINCOUNT": str(resources.SPIN_COUNT)}
    assert resources.bound_spinning({"OMP_WAIT_POLICY": "active"}) == "OMP_WAIT_POLICY=active (from the environment)"
    env = {"GOMP_SPINCOUNT": "0"}
    resources.bound_spinning(env)
    assert env == {"GOMP_SPINCOUNT": "0"}


def test_the_module_does_not_load_torch() -> None:
    """cli.py reads it before torch loads libgomp (GOMP_SPINCOUNT is read then, once)."""
    code = "import sys, braid.server.resources as r; r.threads(); r.available_memory(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_this_machine_gives_at_least_one_thread() -> None:
    threads = resources.threads()
    assert threads.count >= 1 and threads.reason
    assert resources.available_memory().available > 0


def test_the_huge_page_size_is_the_kernels_or_none(tmp_path: Path) -> None:
    thp = tmp_path / "kernel/mm/transparent_hugepage"
    assert resources.huge_page_size(tmp_path) == 0  # a kernel without transparent huge pages
    thp.mkdir(parents=True)
    (thp / "hpage_pmd_size").write_text("2097152\n")
    resources.huge_page_size.cache_clear()
    assert resources.huge_page_size(tmp_path) == 2 * MiB
