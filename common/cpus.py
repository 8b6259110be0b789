"""How many CPUs this process may actually use: the cores of its affinity mask, capped by
the CPU quota of its control group (a Kubernetes pod's CPU limit, ``docker --cpus``).

``os.cpu_count()`` counts the host's cores; a process pinned to a few of them, or in a
container limited to a fraction of them, that starts one thread per host core gets its
threads throttled or preempted in the middle of every parallel region, and every region
then waits for its slowest thread. (Here, beside the other helpers, because the trainer
sizes its thread pools from it and the launcher its ranks' ``OMP_NUM_THREADS``.)
"""

from __future__ import annotations

import math
import os
from pathlib import Path

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_cpus(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process may use (at least 1): its affinity mask's size, or fewer when a
    control group's quota allows fewer (rounded down: a thread that would run on the
    fraction of a CPU is throttled once per period and stalls its parallel regions)."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(proc, cgroup_root)
    if quota is not None:
        cores = min(cores, math.floor(quota))
    return max(1, cores)


def cgroup_cpu_quota(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's control group in CPUs (quota / period, the smallest
    along its ancestors), or None where there is none or it cannot be read (not Linux, no
    cgroup file system)."""
    try:
        memberships = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in memberships:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2, the unified hierarchy
            quotas += _v2_quotas(cgroup_root, path)
        elif "cpu" in controllers.split(","):  # cgroup v1, the cpu controller's hierarchy
            quotas += _v1_quotas(cgroup_root / controllers, path)
    return min(quotas) if quotas else None


def _ancestry(mount: Path, path: str) -> list[Path]:
    """The folders of cgroup ``path`` and its ancestors under ``mount``; inside a container
    whose cgroup namespace hides the path, the mount's root is the container's group."""
    parts = [p for p in path.strip("/").split("/") if p]
    folders = [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [f for f in folders if f.is_dir()] or [mount]


def _v2_quotas(mount: Path, path: str) -> list[float]:
    quotas = []
    for folder in _ancestry(mount, path):
        try:
            quota, period = (folder / "cpu.max").read_text().split()
        except (OSError, ValueError):
            continue
        if quota != "max" and int(period) > 0:
            quotas.append(int(quota) / int(period))
    return quotas


def _v1_quotas(mount: Path, path: str) -> list[float]:
    quotas = []
    for folder in _ancestry(mount, path):
        try:
            quota = int((folder / "cpu.cfs_quota_us").read_text())
            period = int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        if quota > 0 and period > 0:
            quotas.append(quota / period)
    return quotas
