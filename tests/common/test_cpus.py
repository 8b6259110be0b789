"""The CPUs a process may use: affinity mask and control-group quota (v1 and v2), read
from a fake /proc and cgroup file system, and from the real one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from neorec.common.cpus import available_cpus, cgroup_cpu_quota


def _proc(tmp_path: Path, cgroup: str) -> Path:
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text(cgroup)
    return tmp_path / "proc"


def _write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def _affinity() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def test_v2_quota_is_the_smallest_along_the_ancestors(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n")
    root = tmp_path / "cgroup"
    _write(root, {"cpu.max": "max 100000\n"})
    _write(root / "kubepods", {"cpu.max": "800000 100000\n"})
    _write(root / "kubepods" / "pod1", {"cpu.max": "150000 100000\n"})
    _write(root / "kubepods" / "pod1" / "ctr", {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(proc, root) == pytest.approx(1.5)
    assert available_cpus(proc, root) == 1  # rounded down


def test_v2_in_a_cgroup_namespace_reads_the_mount_root(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/\n")
    root = tmp_path / "cgroup"
    _write(root, {"cpu.max": "200000 100000\n"})
    assert cgroup_cpu_quota(proc, root) == pytest.approx(2.0)
    assert available_cpus(proc, root) == min(2, _affinity())


def test_v1_cpu_controller_quota(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    root = tmp_path / "cgroup"
    _write(root / "cpu,cpuacct" / "docker" / "abc", {"cpu.cfs_quota_us": "50000\n", "cpu.cfs_period_us": "100000\n"})
    _write(root / "memory" / "docker" / "abc", {"cpu.cfs_quota_us": "1\n", "cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(proc, root) == pytest.approx(0.5)
    assert available_cpus(proc, root) == 1  # never fewer than one


def test_no_quota_leaves_the_affinity_mask(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "1:cpu:/\n0::/\n")
    root = tmp_path / "cgroup"
    _write(root / "cpu", {"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"})
    _write(root, {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(proc, root) is None
    assert available_cpus(proc, root) == _affinity()
    assert available_cpus(tmp_path / "nowhere", root) == _affinity()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity")
def test_affinity_mask_counts(tmp_path: Path) -> None:
    original = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(original)})
        assert available_cpus(tmp_path / "nowhere", tmp_path) == 1
    finally:
        os.sched_setaffinity(0, original)


def test_real_host_is_at_least_one() -> None:
    assert 1 <= available_cpus() <= _affinity()
