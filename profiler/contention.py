"""Memory bandwidth a process keeps while the other processes of its node stream too.

A device profile measures the streaming bandwidth with one process. Arithmetic is per
core, but memory bandwidth is a node resource: when every rank of a CPU node streams at
once, each gets less than one alone did (2 processes on a 2-core VM: 15 against 22 GB/s
per process at 64 MiB arrays). The cost model's memory-bound terms (activation traffic,
exposed weight passes, the optimizer step) would otherwise assume the single-process
figure in every multi-process run.

Each rank of the group times a streaming copy alone (the others waiting at a barrier) and
then with every rank copying at once; ``contended_share`` is the mean over the ranks of
concurrent over alone. It holds time-sharing too where the ranks outnumber the cores;
``autopar.profiles`` divides that part out, since it applies it itself.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from profiler.timing import Repeats

ARRAY_BYTES = 64 * 2**20
"""Per array: far beyond the caches, small enough for several processes' pairs."""
COPIES_PER_SAMPLE = 4


def contended_share(group: dist.ProcessGroup, ranks: tuple[int, ...], repeats: Repeats) -> float:
    """Concurrent over alone streaming bandwidth, the mean over ``ranks`` (the members of
    ``group``, this rank among them); call on every rank of the group. CPU only."""
    numel = ARRAY_BYTES // 4
    src, dst = torch.rand(numel), torch.empty(numel)
    for _ in range(max(repeats.warmup, 1)):
        dst.copy_(src)
    alone = 0.0
    for r in ranks:
        dist.barrier(group=group)
        if r == dist.get_rank():
            alone = _bandwidth(src, dst, repeats)
        dist.barrier(group=group)
    together = _bandwidth(src, dst, repeats, group)
    share = torch.tensor([together / alone], dtype=torch.float64)
    dist.all_reduce(share, group=group)
    return min(float(share[0]) / len(ranks), 1.0)


def _bandwidth(src: torch.Tensor, dst: torch.Tensor, repeats: Repeats, group: dist.ProcessGroup | None = None) -> float:
    """Median bytes per second of ``COPIES_PER_SAMPLE`` back-to-back copies (read and
    write); with ``group``, every sample starts on all its ranks at once (a rank that ran
    ahead would otherwise stream its last samples alone)."""
    samples = []
    for _ in range(repeats.repeats):
        if group is not None:
            dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(COPIES_PER_SAMPLE):
            dst.copy_(src)
        samples.append(2 * src.numel() * src.element_size() * COPIES_PER_SAMPLE / (time.perf_counter() - start))
    return statistics.median(samples)
