"""The pipeline split's costs: the time of every stage a split may use, as a band.

``band[k, i, w - 1]`` is the per-micro-batch time of stage ``k`` holding the ``w`` units
from ``i`` (:func:`autopar.search.split.best_split` searches it). A model is mostly runs
of identical units, so a range's time depends on few things: for a skeleton (a run of
blocks between at most one unit on each side: a transformer), only the stage and how
many blocks it holds. Those are priced as arrays over the count, once per stage (its
in-flight count, what it sends and receives), from the knapsack's closed form
vectorised over counts and stages (:func:`~autopar.search.run_times.homogeneous_times`,
:func:`~autopar.search.run_times.single_and_run_times`), and the band is filled by
broadcasting them; blocks of two kinds in any order (Gemma 3) by the count of each
kind (:mod:`autopar.search.two_kinds_band`). Another model's ranges (a CNN's mixed
units) are solved as stages, once per distinct content. Entries above a cutoff stay infinite: no split better than
the even one uses a stage dearer than the cutoff, nor one of more units than the cutoff
over the fastest unit's time. A stage's time need not grow with its range (it includes
sending its output, which shrinks along a CNN), so every range within that width is
priced, not only those up to the first over the cutoff.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from autopar.cost.stage import rank_buffer_bytes, stage_p2p_s
from autopar.plan import ParallelConfig
from autopar.search.run_times import homogeneous_times, single_and_run_times
from autopar.search.split import placeable
from autopar.search.two_kinds_band import two_kinds_band
from autopar.vocab import Recompute

if TYPE_CHECKING:
    from autopar.search.solve import ConfigSolver


def cost_band(
    ev: ConfigSolver,
    config: ParallelConfig,
    modes: tuple[Recompute, ...],
    inflight: list[float],
    cutoff_s: float = math.inf,
    *,
    width: int | None = None,
) -> np.ndarray:
    """``band[k, i, w - 1]`` for every stage and range a split can use (module
    docstring), of at most ``width`` units; inf where the range does not fit, a split
    cannot put it there, or it costs more than ``cutoff_s``."""
    n = ev.num_units
    if width is None:
        fastest = min(min(o.time_s for o in ev.options(u, config, modes)) for u, _ in ev.unit_kinds)
        limit = n if not math.isfinite(cutoff_s) or fastest <= 0 else math.floor(cutoff_s / fastest * (1 + 1e-9)) + 1
        width = limit
    width = max(1, min(n - config.pp + 1, width))
    if ev.skeleton is not None and config.pp > 1:
        band = _skeleton_band(ev, config, modes, inflight, width)
    elif ev.two_kinds is not None and config.pp > 1:
        band = two_kinds_band(ev, config, modes, inflight, width)
    else:
        band = _general_band(ev, config, modes, inflight, width)
    band = np.where(band <= cutoff_s, band, np.inf)
    used = np.flatnonzero(np.isfinite(band).any(axis=(0, 1)))
    return band[:, :, : int(used[-1]) + 1] if used.size else band[:, :, :1]


def skeleton_stage_times(
    ev: ConfigSolver, config: ParallelConfig, modes: tuple[Recompute, ...], inflight: list[float], width: int
) -> np.ndarray:
    """``out[k, c]``: the per-micro-batch time of stage ``k`` of a skeleton holding ``c``
    blocks (``c <= width``), point-to-point included: the first stage also holds the
    prologue, the last the epilogue; inf where it does not fit or cannot be (a stage
    without a block or its prologue or epilogue)."""
    shape = ev.skeleton
    n, pp = ev.num_units, config.pp
    out = np.full((pp, width + 1), np.inf)
    if pp > 2:
        out[1 : pp - 1] = _times(ev, config, modes, inflight[1 : pp - 1], shape.block, shape.block + 1, None, width)
    first_units = 1 if shape.prologue is not None else 0  # what stage 0 holds beyond its blocks
    out[0] = _times(ev, config, modes, inflight[:1], 0, first_units + 1, shape.prologue, width)[0]
    last_units = 1 if shape.epilogue is not None else 0
    out[pp - 1] = _times(ev, config, modes, inflight[pp - 1 :], n - 1 - last_units, n, shape.epilogue, width)[0]
    out[1 : pp - 1, 0] = np.inf
    for k, unit in ((0, shape.prologue), (pp - 1, shape.epilogue)):
        if unit is None:
            out[k, 0] = np.inf
        else:  # the prologue or the epilogue alone sends or receives its own tensors
            found = ev.solve_units((unit,), config, modes, inflight[k], k)
            out[k, 0] = math.inf if found is None else ev.stage_cost_s(found[0], config)
    return out


def _skeleton_band(
    ev: ConfigSolver, config: ParallelConfig, modes: tuple[Recompute, ...], inflight: list[float], width: int
) -> np.ndarray:
    """The band of a skeleton: stage 0 holds the prologue and blocks, the last stage
    blocks and the epilogue, the others blocks only; each stage's time by its count."""
    shape = ev.skeleton
    n, pp = ev.num_units, config.pp
    times = skeleton_stage_times(ev, config, modes, inflight, width)
    band = np.full((pp, n + 1, width), np.inf)
    widths = np.arange(1, width + 1)
    starts = np.arange(n + 1)[:, None]
    inside = (starts >= shape.block) & (starts + widths[None, :] <= shape.block + shape.count)
    band[1 : pp - 1] = np.where(inside[None], times[1 : pp - 1, None, 1:], np.inf)
    first_units = 1 if shape.prologue is not None else 0
    band[0, 0, :] = times[0, widths - first_units]
    last_units = 1 if shape.epilogue is not None else 0
    band[pp - 1, n - widths, widths - 1] = times[pp - 1, widths - last_units]
    return np.where(placeable(n, pp, width), band, np.inf)


def _times(
    ev: ConfigSolver,
    config: ParallelConfig,
    modes: tuple[Recompute, ...],
    levels: list[float],
    i: int,
    j: int,
    single: int | None,
    width: int,
) -> np.ndarray:
    """``out[l, c]``: the time of a stage shaped like ``[i, j)`` (a run of blocks, with the
    unit ``single`` beside them where given) holding ``c`` blocks, point-to-point
    included, with ``levels[l]`` micro-batches in flight, for every ``c <= width``
    (memoised per shape and in-flight count)."""
    ends = (i > 0, j < ev.num_units)
    block = ev.skeleton.block
    base = ("blocks", None if single is None else ev.unit_keys[single], ends, ev.config_key(config, modes))
    base += (config.num_microbatches,)
    missing = [x for x in dict.fromkeys(levels) if (found := ev._memo.get((*base, x))) is None or found.size <= width]
    if missing:
        run_opts = ev.priced_options(block, config, modes)[1]
        layout = ev.any_layout(config, modes)
        buffers = np.array([rank_buffer_bytes(ev.model, tuple(range(i, j)), config, x, layout) for x in missing])
        rooms = ev.budget_bytes - buffers
        if single is None:
            times = homogeneous_times(run_opts, width, rooms, np.asarray(missing))
        else:
            single_opts = ev.priced_options(single, config, modes)[1]
            times = np.stack([single_and_run_times(single_opts, run_opts, width, r, x) for r, x in zip(rooms, missing)])
        first = ev.options(i, config, modes)[0]
        last = ev.options(j - 1, config, modes)[0]
        f, b = stage_p2p_s(ev.model, (i, j - 1), (first, last), config)
        for x, row in zip(missing, times + (f + b)):
            ev._memo[(*base, x)] = row
    return np.stack([ev._memo[(*base, x)][: width + 1] for x in levels])


def _general_band(
    ev: ConfigSolver, config: ParallelConfig, modes: tuple[Recompute, ...], inflight: list[float], width: int
) -> np.ndarray:
    """The band of any model: each range a split can use solved as a stage, once per
    distinct content and in-flight count."""
    n, pp = ev.num_units, config.pp
    band = np.full((pp, n + 1, width), np.inf)
    for k in range(pp):
        lo_i, hi_i = (0, 0) if k == 0 else (k, n - (pp - k))
        lo_j, hi_j = (n, n) if k == pp - 1 else (k + 1, n - (pp - k - 1))
        values: dict[int, float] = {}
        for i in range(lo_i, hi_i + 1):
            for j in range(max(i + 1, lo_j), min(hi_j, i + width) + 1):
                content = int(ev.range_signature[i, j])
                if content not in values:
                    found = ev.solve_units(tuple(range(i, j)), config, modes, inflight[k], k)
                    values[content] = math.inf if found is None else ev.stage_cost_s(found[0], config)
                band[k, i, j - i - 1] = values[content]
    return band


def split_cutoff(
    ev: ConfigSolver, config: ParallelConfig, modes: tuple[Recompute, ...], inflight: list[float]
) -> float:
    """``T_even / m``: in any split no worse than the even one, every stage costs at
    most this, since ``(m - 1) max c + sum c >= m c_k`` for each stage ``k``."""
    bounds = ev.even_split(config.pp)
    if bounds is None or config.pp == 1:
        return math.inf
    sizes = [bounds[k + 1] - bounds[k] for k in range(config.pp)]
    band = cost_band(ev, config, modes, inflight, width=max(sizes))
    costs = [
        float(band[k, bounds[k], sizes[k] - 1]) if sizes[k] <= band.shape[2] else math.inf for k in range(config.pp)
    ]
    if not all(math.isfinite(c) for c in costs):
        return math.inf
    m = config.num_microbatches
    return ((m - 1) * max(costs) + sum(costs)) / m * (1 + 1e-12)
