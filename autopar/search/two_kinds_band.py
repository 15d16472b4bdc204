"""The pipeline split's band for a model of two kinds of repeated blocks.

Gemma 3 puts one global-attention layer after five sliding-window ones; a model may
follow each dense block with a mixture-of-experts one. Between its first unit and its
last, such a model is blocks of two kinds in any order, so what a stage of it costs
depends only on how many blocks of each kind it holds, which units bound it (what it
receives and sends), and the stage (its in-flight micro-batches, and the first and last
stage's own unit). :func:`two_kinds_band` prices every pair of counts once per stage
as arrays, as :func:`autopar.search.stage_solver.solve_stage` solves one range: for
every transient level, every count of the rarer kind's options on its time-memory
frontier, and the commoner kind's closed form
(:func:`autopar.search.run_times.run_times`) for the memory each leaves, vectorised
over those frontiers, over a window of the commoner kind's counts, and over the stages
(each its in-flight count and budget), where solving each range as a stage would solve
every distinct one on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from autopar.cost.stage import runs_buffer_bytes, stage_p2p_s
from autopar.plan import ParallelConfig
from autopar.search.run_times import run_times
from autopar.search.split import placeable
from autopar.search.stage_solver import Priced, frontier
from autopar.vocab import Recompute

if TYPE_CHECKING:
    from autopar.graph.layer_graph import LayerGraph
    from autopar.search.solve import ConfigSolver


@dataclass(frozen=True, kw_only=True)
class TwoKinds:
    """A model as its first unit, blocks of two kinds in any order, and its last unit:
    ``rare[u]`` says whether unit ``u`` is a block of the kind with fewer blocks
    (``rare_unit`` is one of them, ``common_unit`` one of the others)."""

    rare: tuple[bool, ...]
    rare_unit: int
    common_unit: int

    @cached_property
    def rare_before(self) -> np.ndarray:
        """``rare_before[u]``: how many rare blocks come before unit ``u`` (``u`` up to
        the number of units)."""
        return np.concatenate([[0], np.cumsum(self.rare)])

    @cached_property
    def blocks_before(self) -> np.ndarray:
        """``blocks_before[u]``: how many blocks of either kind come before unit ``u``."""
        n = len(self.rare)
        return np.concatenate([[0], np.cumsum([0 < u < n - 1 for u in range(n)])])

    def range_counts(self, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For the range of ``w`` units from unit ``i``, every start ``i`` (up to the
        number of units) and width ``w`` up to ``width``: ``ends[i, w - 1]``, where it
        ends (at most the number of units), and ``rare[i, w - 1]`` and
        ``common[i, w - 1]``, how many blocks of each kind it holds."""
        starts = np.arange(len(self.rare) + 1)[:, None]
        ends = np.minimum(starts + np.arange(1, width + 1)[None, :], len(self.rare))
        rare = self.rare_before[ends] - self.rare_before[starts]
        return ends, rare, self.blocks_before[ends] - self.blocks_before[starts] - rare


def two_kinds_of(unit_keys: tuple[tuple, ...], graph: LayerGraph) -> TwoKinds | None:
    """The model's shape as :class:`TwoKinds`, or None where the units between the
    first and the last are not of exactly two kinds, or where a parameter shared
    between blocks could be held once in a stage (what a range solved as a stage
    counts, :meth:`autopar.search.solve.ConfigSolver.solve_units`)."""
    n = len(unit_keys)
    middle = unit_keys[1 : n - 1]
    kinds = list(dict.fromkeys(middle))
    if len(kinds) != 2 or unit_keys[0] in kinds or unit_keys[-1] in kinds:
        return None
    if any({s.first_unit, s.second_unit} & set(range(1, n - 1)) for s in graph.shared):
        return None
    rare_key = min(kinds, key=lambda k: (middle.count(k), kinds.index(k)))
    rare = tuple(0 < u < n - 1 and key == rare_key for u, key in enumerate(unit_keys))
    common = next(u for u in range(1, n - 1) if not rare[u])
    return TwoKinds(rare=rare, rare_unit=rare.index(True), common_unit=common)


def two_kinds_band(
    ev: ConfigSolver, config: ParallelConfig, modes: tuple[Recompute, ...], inflight: list[float], width: int
) -> np.ndarray:
    """``band[k, i, w - 1]`` (:func:`autopar.search.split_table.cost_band`) of a
    :class:`TwoKinds` model over ``config.pp > 1`` stages: stage 0 holds the first unit
    and blocks, the last stage blocks and the last unit, the others blocks only; inf
    where a range does not fit or a split cannot put it there."""
    shape = ev.two_kinds
    n, pp = ev.num_units, config.pp
    ends, a, b = shape.range_counts(width)
    # each range's first and last unit by kind: 0 the first unit, 1 rare, 2 common, 3 the last unit
    kind = np.where(shape.rare, 1, 2)
    kind[0], kind[n - 1] = 0, 3
    first_kind = kind[np.minimum(np.arange(n + 1), n - 1)][:, None].repeat(width, axis=1)
    last_kind = kind[ends - 1]
    reps = {0: 0, 1: shape.rare_unit, 2: shape.common_unit, 3: n - 1}
    layout = ev.any_layout(config, modes)
    band = np.full((pp, n + 1, width), np.inf)
    places, stages = [], []
    for k in range(pp):
        single = 0 if k == 0 else n - 1 if k == pp - 1 else None
        for f in (0,) if k == 0 else (1, 2, 3) if k == pp - 1 else (1, 2):
            for g in (3,) if k == pp - 1 else (0, 1, 2) if k == 0 else (1, 2):
                here = (first_kind == f) & (last_kind == g)
                if not here.any():
                    continue
                runs = [(reps[f], reps[g])]
                room = ev.budget_bytes - runs_buffer_bytes(ev.model, runs, config, inflight[k], layout)
                first, last = ev.options(reps[f], config, modes)[0], ev.options(reps[g], config, modes)[0]
                p2p = sum(stage_p2p_s(ev.model, (reps[f], reps[g]), (first, last), config))
                places.append((k, here, p2p, _fits_rebuild(ev, config, modes, single, a[here], b[here])))
                stages.append((inflight[k], single, room, a[here], b[here]))
    for (k, here, p2p, fits), times in zip(places, _count_times(ev, config, modes, stages)):
        band[k][here] = np.where(fits, times + p2p, np.inf)
    return np.where(placeable(n, pp, width), band, np.inf)


def _count_times(
    ev: ConfigSolver,
    config: ParallelConfig,
    modes: tuple[Recompute, ...],
    stages: list[tuple[float, int | None, float, np.ndarray, np.ndarray]],
) -> list[np.ndarray]:
    """Per stage ``(inflight, single, room_bytes, rare_count, common_count)``: the
    fastest time of ``rare_count`` rare and ``common_count`` common blocks (and the unit
    ``single``, where given) in one stage with ``inflight`` micro-batches in flight
    within ``room_bytes``, pair by pair; inf where they do not fit. Memoised per stage
    and budget, each pair once; the pairs missing are priced together, one batch per
    ``single``."""
    keys, batches = [], {}
    for inflight, single, room, rare_count, common_count in stages:
        key = ("two kinds", ev.config_key(config, modes), inflight, single is None or ev.unit_keys[single], room)
        shape = (int(rare_count.max()) + 1, int(common_count.max()) + 1)
        table = ev._memo.get(key, np.full((0, 0), np.nan))
        if table.shape[0] < shape[0] or table.shape[1] < shape[1]:
            grown = np.full(np.maximum(table.shape, shape), np.nan)
            grown[: table.shape[0], : table.shape[1]] = table
            ev._memo[key] = table = grown
        keys.append(key)
        missing = np.isnan(table[rare_count, common_count])
        if missing.any():  # stages of one key ask for the union of their pairs
            _, _, _, a, b = batches.setdefault(single, {}).get(key, (table, inflight, room, (), ()))
            a, b = np.append(a, rare_count[missing]), np.append(b, common_count[missing])
            batches[single][key] = (table, inflight, room, a, b)
    shape = ev.two_kinds
    rare_opts = ev.priced_options(shape.rare_unit, config, modes)[1]
    common_opts = ev.priced_options(shape.common_unit, config, modes)[1]
    for single, batch in batches.items():
        # each stage's rare counts, with a window of the common counts they need
        rows = []
        for table, inflight, room, a, b in batch.values():
            for r in np.unique(a):
                rows.append((table, inflight, room, int(r), int(b[a == r].min()), int(b[a == r].max())))
        span = max(hi - lo for *_, lo, hi in rows) + 1
        counts = np.array([np.minimum(lo + np.arange(span), t.shape[1] - 1) for t, *_, lo, _ in rows])
        single_opts = None if single is None else ev.priced_options(single, config, modes)[1]
        times = _times(
            rare_opts,
            common_opts,
            single_opts,
            np.array([x for _, x, *_ in rows]),
            np.array([room for _, _, room, *_ in rows]),
            np.array([r for *_, r, _, _ in rows]),
            counts,
        )
        for (table, *_, r, _, _), c, t in zip(rows, counts, times):
            table[r, c] = t
    return [ev._memo[key][a, b] for key, (*_, a, b) in zip(keys, stages)]


def _times(
    rare_opts: tuple[Priced, ...],
    common_opts: tuple[Priced, ...],
    single: tuple[Priced, ...] | None,
    inflight: np.ndarray,
    room_bytes: np.ndarray,
    rares: np.ndarray,
    commons: np.ndarray,
) -> np.ndarray:
    """``out[r, c]``: the fastest time of ``rares[r]`` blocks with options ``rare_opts``
    and ``commons[r, c]`` with ``common_opts`` (and one unit with options ``single``,
    where given) in one stage with ``inflight[r]`` micro-batches in flight within
    ``room_bytes[r]``: per transient level, every way on the rare count's frontier beside
    the common blocks' closed form for the memory it leaves."""
    single_opts: tuple[Priced | None, ...] = (None,) if single is None else single
    out = np.full(commons.shape, np.inf)
    every = (*rare_opts, *common_opts, *(s for s in single_opts if s is not None))
    for tau in sorted({o.transient_bytes for o in every}):
        singles = [s for s in single_opts if s is None or s.transient_bytes <= tau]
        allowed_rare = tuple(o for o in rare_opts if o.transient_bytes <= tau)
        allowed_common = [i for i, o in enumerate(common_opts) if o.transient_bytes <= tau]
        # each row's frontier of ways, stacked
        owner = np.flatnonzero((rares == 0) | bool(allowed_rare))
        if not singles or not owner.size:
            continue
        ways = [
            (np.zeros(1), np.zeros(1)) if rares[g] == 0 else frontier(int(rares[g]), allowed_rare, inflight[g])[:2]
            for g in owner
        ]
        sizes = [len(w) for w, _ in ways]
        weight = np.concatenate([w for w, _ in ways])
        time = np.concatenate([t for _, t in ways])
        first_row = np.cumsum([0, *sizes[:-1]])
        row_inflight = np.repeat(inflight[owner], sizes)
        row_room = np.repeat(room_bytes[owner], sizes)
        row_counts = np.repeat(commons[owner], sizes, axis=0)
        for s in singles:
            s_bytes = 0.0 if s is None else s.static_bytes + row_inflight * s.act_bytes
            s_time = 0.0 if s is None else s.time_s
            rooms = row_room - tau - s_bytes - weight
            common = run_times(common_opts, allowed_common, 0, rooms, row_inflight, counts=row_counts)
            best = np.minimum.reduceat(s_time + time[:, None] + common, first_row, axis=0)
            out[owner] = np.minimum(out[owner], best)
    return out


def _fits_rebuild(
    ev: ConfigSolver,
    config: ParallelConfig,
    modes: tuple[Recompute, ...],
    single: int | None,
    rare_count: np.ndarray,
    common_count: np.ndarray,
) -> np.ndarray:
    """Whether stages of these counts also fit DDP's one-time bucket rebuild
    (:func:`autopar.cost.peak.fits_bucket_rebuild`): every option of a unit holds the
    same states where it rebuilds, so it depends on the counts alone."""
    shape = ev.two_kinds
    units = [(shape.rare_unit, rare_count), (shape.common_unit, common_count)]
    if single is not None:
        units.append((single, 1))
    static = sum(c * ev.priced_options(u, config, modes)[1][0].static_bytes for u, c in units)
    rebuild = sum(c * ev.priced_options(u, config, modes)[1][0].rebuild_bytes for u, c in units)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (rebuild == 0.0) | (static * (1 + rebuild / static) <= ev.budget_bytes)
