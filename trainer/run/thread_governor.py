"""Training threads that follow the CPUs other processes leave (``train.threads = 0``).

A step is dozens of short parallel regions (the embedding kernels, torch's operators), each
ending when its slowest thread does. On a host where another process keeps a core busy,
one of the training threads is preempted in the middle of most regions, and the others
wait for it: with two threads and one competing process on two cores, a step runs at well
under half its quiet speed, slower than with one thread. The count that :func:`set_threads`
sizes from the process's CPUs (affinity, control group quota) is right on a quiet host and
too many on a shared one, and the load of a shared host changes while a job runs.

:class:`ThreadGovernor` watches, four times a second, how much of the CPUs this process runs
on other processes use (``/proc/stat`` against the process's own CPU time) and trains with
as many threads as are left: one CPU's worth of other load takes one thread away, and the
threads come back when the other load leaves. Changing the count between steps changes no
result: the embedding kernels give the same bits whatever the count (a fixed order of every
sum), and :func:`dense_thread_invariant` checks, before the governor is used, that torch's
dense layers do too for this model's shapes on this machine; where they do not, the count
stays fixed (same config and seed, same weights, whatever the load).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from neorec.trainer.config import TrainConfig
from neorec.trainer.model import DLRM
from neorec.trainer.run.step import use_threads

log = logging.getLogger(__name__)

PROC_STAT = Path("/proc/stat")
PERIOD_S = 0.25
"""Seconds between two looks at the load."""
CONFIRMATIONS = 2
"""Consecutive looks that must agree on a new count before it is taken (no flapping on a
short burst of load)."""
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""Of a ``/proc/stat`` cpu line's times: user, nice, system, irq, softirq, steal (a
hypervisor running another guest on this CPU is load too)."""


def thread_ladder(maximum: int) -> list[int]:
    """The counts the governor may choose, largest first: ``maximum``, then halvings down to 1
    (``[8, 4, 2, 1]`` for 8; every count of the ladder is checked for identical results)."""
    counts = [maximum]
    while counts[-1] > 1:
        counts.append(counts[-1] // 2)
    return counts


def busy_seconds(cpus: Sequence[int], stat: Path = PROC_STAT) -> float | None:
    """Seconds the ``cpus`` have been busy since boot (all processes), from ``stat``; None
    where it cannot be read (not Linux)."""
    wanted = {f"cpu{c}" for c in cpus}
    ticks = 0
    found = 0
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(" ")
        if name in wanted:
            fields = rest.split()
            ticks += sum(int(fields[i]) for i in BUSY_FIELDS if i < len(fields))
            found += 1
    return ticks / os.sysconf("SC_CLK_TCK") if found == len(wanted) else None


def own_cpu_seconds() -> float:
    """CPU seconds this process has used, all of its threads."""
    times = os.times()
    return times.user + times.system


class ThreadGovernor:
    """Sets the training threads (one of ``ladder``, largest first) from the CPUs that other
    processes leave of ``cpus``; :meth:`after_step` is called between steps."""

    def __init__(self, ladder: Sequence[int], cpus: Sequence[int], clock: Callable[[], float] = time.monotonic,
                 busy: Callable[[], float | None] | None = None, own: Callable[[], float] = own_cpu_seconds,
                 apply: Callable[[int], object] = use_threads) -> None:
        self.ladder = list(ladder)
        self.cpus = len(cpus)
        self.clock = clock
        self.busy = busy or (lambda: busy_seconds(cpus))
        self.own = own
        self.apply = apply
        self.threads = self.ladder[0]
        self._pending: tuple[int, int] | None = None
        """A different count the last looks chose, and how many looks in a row chose it."""
        self._last = self._sample()
        self._due = self._last[0] + PERIOD_S

    def _sample(self) -> tuple[float, float | None, float]:
        return self.clock(), self.busy(), self.own()

    def after_step(self) -> None:
        """Look at the load if a period has passed since the last look; change the threads
        once :data:`CONFIRMATIONS` looks in a row chose the same other count."""
        if self.clock() < self._due:
            return
        now = self._sample()
        (then, busy_then, own_then), (wall, busy_now, own_now) = self._last, now
        self._last, self._due = now, now[0] + PERIOD_S
        if busy_then is None or busy_now is None or wall <= then:
            return
        other = max(0.0, (busy_now - busy_then) - (own_now - own_then)) / (wall - then)
        wanted = self.count_for(other)
        if wanted == self.threads:
            self._pending = None
            return
        seen = self._pending[1] + 1 if self._pending and self._pending[0] == wanted else 1
        self._pending = (wanted, seen)
        if seen >= CONFIRMATIONS:
            log.info("training threads %d -> %d: other processes use %.2f of the %d CPUs this process runs on",
                     self.threads, wanted, other, self.cpus)
            self.apply(wanted)
            self.threads, self._pending = wanted, None

    def count_for(self, other: float) -> int:
        """The largest count of the ladder that the CPUs left by ``other`` CPUs of load hold
        (the CPUs left rounded to the nearest whole one, at least one thread)."""
        left = max(1, int(self.cpus - other + 0.5))
        return next((c for c in self.ladder if c <= left), self.ladder[-1])


def dense_thread_invariant(model: DLRM, train_batch_sizes: Sequence[int], eval_batch_sizes: Sequence[int],
                           counts: Sequence[int], seed: int = 0) -> bool:
    """Whether ``model``'s dense layers (bottom MLP, interaction, top MLP and the loss) give
    the same bits with each of ``counts`` threads, used as training uses them, on random
    batches: the loss, logits and every gradient of a forward and backward of each of
    ``train_batch_sizes`` samples, the logits of a forward of each of ``eval_batch_sizes``
    (evaluation computes no gradient: a sum over an eval batch's samples that the thread
    count changes is no reason to keep the count fixed); each also of one sample (a last
    partial batch's shapes lie between). Runs on copies: the model is not changed. Leaves
    the threads at ``counts[0]``."""
    results: dict[int, list[list[torch.Tensor]]] = {}
    for count in counts:
        use_threads(count)
        results[count] = [*(_dense_step(model, rows, seed) for rows in (*train_batch_sizes, 1)),
                          *(_dense_forward(model, rows, seed) for rows in (*eval_batch_sizes, 1))]
    use_threads(counts[0])
    first = results[counts[0]]
    return all(torch.equal(a, b) for count in counts[1:] for step, other in zip(first, results[count])
               for a, b in zip(step, other))


def _dense_step(model: DLRM, rows: int, seed: int) -> list[torch.Tensor]:
    """Loss, logits and every gradient of a forward and backward of copies of ``model``'s
    dense layers on a random batch of ``rows`` samples."""
    bottom, top = copy.deepcopy(model.bottom), copy.deepcopy(model.top)
    dense, pooled, labels = _random_batch(model, rows, seed)
    pooled.requires_grad_()
    logits = top(model.interaction(bottom(dense), pooled)).squeeze(1)
    loss = F.binary_cross_entropy_with_logits(logits, labels)
    loss.backward()
    return [loss.detach(), logits.detach(), pooled.grad, *(p.grad for p in [*bottom.parameters(), *top.parameters()])]


def _dense_forward(model: DLRM, rows: int, seed: int) -> list[torch.Tensor]:
    """The logits of ``model``'s dense layers on a random batch of ``rows`` samples, as
    evaluation computes them (no gradient)."""
    dense, pooled, _ = _random_batch(model, rows, seed)
    with torch.no_grad():
        return [model.top(model.interaction(model.bottom(dense), pooled)).squeeze(1)]


def _random_batch(model: DLRM, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense features ``[rows, D]``, pooled embeddings ``[rows, E]`` and 0/1 labels
    ``[rows]`` (float32), drawn from ``seed``, on the model's device."""
    generator = torch.Generator().manual_seed(seed)
    device = next(model.top.parameters()).device
    dense = torch.randn(rows, model.bottom[0].in_features, generator=generator).to(device)
    pooled = torch.randn(rows, model.embeddings.output_dim, generator=generator).to(device)
    labels = torch.randint(0, 2, (rows,), generator=generator).float().to(device)
    return dense, pooled, labels


def governor_for(model: DLRM, config: TrainConfig, threads: int, device: torch.device) -> ThreadGovernor | None:
    """The governor of a run that trains with ``threads`` threads (what :func:`set_threads`
    chose), or None where the count stays fixed: ``train.threads`` set explicitly, one
    thread, a CUDA device or torch-op kernels (whose sums are not checked to be
    thread-count free), no ``/proc/stat``, or dense layers whose results depend on the count."""
    if config.train.threads or threads == 1 or device.type != "cpu" or config.train.kernels == "torch":
        return None
    if not hasattr(os, "sched_getaffinity"):  # not Linux: no per-CPU load to read either
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if busy_seconds(cpus) is None:
        return None
    ladder = thread_ladder(threads)
    if not dense_thread_invariant(model, (config.train.batch_size,), (config.train.eval_batch_size,), ladder,
                                  config.train.seed):
        log.info("training threads stay at %d: this model's dense layers give different bits with fewer threads "
                 "on this machine", threads)
        return None
    return ThreadGovernor(ladder, cpus)
