"""The intra-op search: a tensor-parallel style for every leaf of a unit.

A unit of a few leaves has a few thousand layouts: they are all priced at once
(:mod:`autopar.cost.layout_table`) and the fastest taken. Larger units go to an integer
program: as Alpa's intra-operator pass (Zheng et al. 2022, section 4), each leaf picks one style
(binary ``x[l, s]``), edges pay resharding costs that depend on the styles at both ends
(linearised with ``y >= x_a + x_b - 1``), and the objective is the unit's forward plus
backward time on one micro-batch. Unlike Alpa, a conversion is charged once per producer
and target layout however many consumers need it, and the partial input gradient of
column-parallel consumers once per producer (see :mod:`autopar.cost.tensor_parallel`,
whose :func:`evaluate_layout` is the reference both are tested against).

Only layouts the runtime can run are taken: the cost model prices each flow's
conversion on its own and so admits layouts whose tensors would meet in user code in
two layouts, which the runtime refuses (:func:`autopar.runtime.layouts.refusal`); the
table is read in order of time until one runs, and the integer program excludes each
refused answer and is solved again. Where none runs (a last unit that hands its own
sequence-sharded input to the loss), the fastest is taken and the runtime refuses it by
name.

Solved once per distinct unit structure, TP degree and boundary layout (and, only
where the costs are not affine in it, micro-batch size); a 96-block GPT needs one block
solve per such configuration, not 96.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from autopar.cost.layout_copies import conversion_copy_s, reduction_copy_s
from autopar.cost.layout_table import LAYOUTS, LayoutGrid, layout_grid, layout_table
from autopar.cost.leaf import (
    BACKWARD_FACTOR,
    TPContext,
    allowed_styles,
    glue_layout,
    glue_step_s,
    leaf_accumulate_s,
    leaf_fwd_s,
    leaf_param_numel,
)
from autopar.cost.loss import loss_parallel_s
from autopar.cost.tensor_parallel import (
    UnitCost,
    consumers,
    conversion_s,
    evaluate_layout,
    matmul_s,
    model_output_layout,
    producer_bytes,
    reduction_s,
    reduction_transfer_s,
    transfer_s,
)
from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT, UnitProfile
from autopar.runtime.layouts import refusal
from autopar.runtime.style_checks import always_refused
from autopar.search.ilp import Infeasible, Program, check_solver, solve
from autopar.vocab import STYLE_IO, Layout, TPStyle

MICROSECONDS = 1e6
"""The layout program's objective and its hidden-time rows are in microseconds: HiGHS
stops at an absolute gap of 1e-6 and tolerates row violations of that order, which in
seconds would blur layouts a microsecond apart."""

MAX_REFUSED = 1_000
"""How many layouts the integer program may propose that the runtime refuses (each is
excluded and the program solved again) before it takes its first answer. Refused
layouts are few among a real block's fastest; a random unit's can be dozens, and a
unit with fewer layouts than this gets the exact answer."""

TABLE_LIMIT = 200_000
"""Layout spaces up to this size are priced whole (:mod:`autopar.cost.layout_table`),
exactly like the ILP, in far less time; larger ones (a block of many experts) go to the
integer program."""


class LayoutSolver:
    """Finds, and caches, the fastest layout and the fastest of the smallest layouts of
    each unit structure.

    Without measured matmul curves a layout's time is affine in the micro-batch size
    ``b`` (roofline terms scale with ``b``; collective latencies do not), so the best time
    over layouts is concave in ``b``: a layout optimal at the smallest and the largest
    ``b`` of the search is optimal at every ``b`` between them, and two solves serve all
    micro-batch sizes.
    """

    def __init__(self, *, solver: str = "highs", micro_batches: tuple[int, ...] = (), table_limit: int = TABLE_LIMIT):
        self._solver = check_solver(solver)
        self._table_limit = table_limit
        self._ends = (min(micro_batches), max(micro_batches)) if micro_batches else ()
        self._cache: dict[tuple, tuple[tuple[TPStyle, ...], Layout]] = {}
        self._grids: dict[tuple, LayoutGrid] = {}
        self.solves = 0

    def fastest(self, profile: UnitProfile, ctx: TPContext) -> UnitCost:
        """The fastest layout (forward plus backward of one micro-batch)."""
        return self._layout(profile, ctx, small=False)

    def smallest(self, profile: UnitProfile, ctx: TPContext) -> UnitCost:
        """The fastest of the layouts the runtime runs that hold the fewest parameters
        of any it runs (often the fastest layout itself, which then needs no second
        solve)."""
        fast = self._layout(profile, ctx, small=False)
        if fast.param_numel <= self._fewest(profile, ctx):
            return fast
        return self._layout(profile, ctx, small=True)

    @staticmethod
    def _fewest(profile: UnitProfile, ctx: TPContext) -> float:
        """The fewest parameters any layout holds, run or not (separable per leaf): a
        fastest layout holding no more is the smallest too."""
        return _cap(
            sum(
                min(leaf_param_numel(leaf, s, ctx.tp, ctx.ep) for s in allowed_styles(leaf, ctx))
                for leaf in profile.leaves
            )
        )

    def _layout(self, profile: UnitProfile, ctx: TPContext, *, small: bool) -> UnitCost:
        options = _options(profile, ctx)
        outputs = ctx.output_layouts()
        key = (
            id(profile),
            ctx.tp,
            ctx.ep,
            ctx.compile,
            ctx.fp8,
            ctx.async_tp,
            ctx.sequence_parallel,
            ctx.first,
            ctx.last,
            ctx.boundary,
            ctx.rates,
            small,
        )
        b = ctx.micro_batch
        affine = not ctx.rates.curve
        if affine and self._ends and self._ends[0] <= b <= self._ends[1]:
            lo = self._styles(profile, replace(ctx, micro_batch=self._ends[0]), options, outputs, small, key)
            hi = self._styles(profile, replace(ctx, micro_batch=self._ends[1]), options, outputs, small, key)
            if lo == hi:
                return evaluate_layout(profile, lo[0], lo[1], ctx)
        styles, output = self._styles(profile, ctx, options, outputs, small, key)
        return evaluate_layout(profile, styles, output, ctx)

    def _styles(self, profile, ctx, options, outputs, small, key) -> tuple[tuple[TPStyle, ...], Layout]:
        full_key = (*key, ctx.micro_batch)
        if full_key not in self._cache:
            combinations = math.prod(len(o) for o in options)
            if combinations <= self._table_limit:
                self._cache[full_key] = _from_table(profile, ctx, self._grid(profile, ctx, options), small=small)
            else:
                self.solves += 1
                cap = _fewest_runnable(profile, ctx, options, self._solver) if small else None
                self._cache[full_key] = _solve_ilp(profile, ctx, options, outputs, self._solver, param_cap=cap)
        return self._cache[full_key]

    def _grid(self, profile: UnitProfile, ctx: TPContext, options: list[tuple[TPStyle, ...]]) -> LayoutGrid:
        """The unit's layout combinations for ``ctx``'s input and output rule, built once
        and priced in every context (:class:`autopar.cost.layout_table.LayoutGrid`)."""
        key = (id(profile), tuple(options), ctx.input_layout, ctx.output_layouts())
        if key not in self._grids:
            self._grids[key] = layout_grid(profile, options, ctx.input_layout, ctx.output_layouts())
        return self._grids[key]


def _options(profile: UnitProfile, ctx: TPContext) -> list[tuple[TPStyle, ...]]:
    """Per leaf, the styles it may take at this TP degree, less those the runtime refuses
    whatever the other leaves take (:func:`autopar.runtime.style_checks.always_refused`)."""
    return [
        tuple(s for s in allowed_styles(leaf, ctx) if not always_refused(profile, i, s, last=ctx.last))
        for i, leaf in enumerate(profile.leaves)
    ]


def refusal_in(profile: UnitProfile, styles: tuple[TPStyle, ...], ctx: TPContext) -> str | None:
    """Why the runtime refuses ``profile`` under ``styles`` in ``ctx``'s layouts, or None
    (:func:`autopar.runtime.layouts.refusal`)."""
    return refusal(
        profile,
        styles,
        arrives=ctx.input_layout,
        boundary=ctx.boundary,
        last=ctx.last,
        loss_parallel=ctx.loss_parallel,
    )


def _runs(profile: UnitProfile, styles: tuple[TPStyle, ...], ctx: TPContext) -> bool:
    return refusal_in(profile, styles, ctx) is None


def _from_table(profile, ctx, grid: LayoutGrid, *, small: bool) -> tuple[tuple[TPStyle, ...], Layout]:
    """The fastest layout the runtime can run (``small``: of those holding the fewest
    parameters of any it runs) by pricing them all
    (:func:`autopar.cost.layout_table.layout_table`); where none runs, the fastest
    (module docstring)."""
    table, options = layout_table(grid, profile, ctx), grid.options

    def picked(c: int) -> tuple[tuple[TPStyle, ...], Layout]:
        return tuple(opts[k] for opts, k in zip(options, table.choice[c].tolist())), LAYOUTS[int(table.output[c])]

    time = table.time_s
    if small:
        fewest = next(
            (float(table.param_numel[c]) for c in _ascending(table.param_numel) if _runs(profile, picked(c)[0], ctx)),
            None,
        )
        if fewest is not None:
            time = np.where(table.param_numel <= _cap(fewest), time, np.inf)
    for c in _ascending(time):
        if not np.isfinite(time[c]):
            break
        if _runs(profile, picked(c)[0], ctx):
            return picked(c)
    return picked(int(np.argmin(time)))


def _ascending(values: np.ndarray, eager: int = 8) -> Iterator[int]:
    """The indices of ``values`` from the smallest, ties in index order (a stable sort's
    order): the first few by repeated minimum, as the search mostly takes the first
    layout it is offered, and the rest by sorting them all."""
    work = np.array(values, dtype=float)
    taken: set[int] = set()
    for _ in range(eager):
        c = int(np.argmin(work))
        if not np.isfinite(work[c]):
            break
        taken.add(c)
        yield c
        work[c] = np.inf
    yield from (c for c in np.argsort(values, kind="stable").tolist() if c not in taken)


def _cap(numel: float) -> float:
    """Parameters within rounding of ``numel``: the layouts a smallest one is chosen among."""
    return numel * (1 + 1e-9) + 1e-6


def _fewest_runnable(profile: UnitProfile, ctx: TPContext, options, solver: str) -> float | None:
    """A parameter cap holding the layouts with the fewest parameters of any the runtime
    runs (an integer program over the styles, each refused answer excluded); None where
    none runs within :data:`MAX_REFUSED` answers."""
    prog = Program("fewest_params")
    x = {
        (i, s): prog.binary(cost=leaf_param_numel(profile.leaves[i], s, ctx.tp, ctx.ep))
        for i, opts in enumerate(options)
        for s in opts
    }
    for i, opts in enumerate(options):
        prog.constrain({x[i, s]: 1.0 for s in opts}, lower=1.0, upper=1.0)
    for _, styles in _answers(prog, x, options, solver):
        if _runs(profile, styles, ctx):
            return _cap(sum(leaf_param_numel(leaf, s, ctx.tp, ctx.ep) for leaf, s in zip(profile.leaves, styles)))
    return None


def _answers(prog: Program, x: dict[tuple[int, TPStyle], int], options, solver: str):
    """``prog``'s answers best first, at most :data:`MAX_REFUSED`: each one's values and
    the styles its variables ``x`` pick, excluded from the next (a no-good cut) when the
    caller asks for another; none left where the program becomes infeasible."""
    for _ in range(MAX_REFUSED):
        try:
            values = solve(prog, solver)
        except Infeasible:
            return
        styles = tuple(next(s for s in opts if values[x[i, s]] > 0.5) for i, opts in enumerate(options))
        yield values, styles
        prog.constrain({x[i, s]: 1.0 for i, s in enumerate(styles)}, upper=len(styles) - 1.0)


def brute_force_layout(profile: UnitProfile, ctx: TPContext) -> UnitCost:
    """The fastest layout the runtime can run (where none runs, the fastest), by
    enumerating every assignment (exponential: tests only)."""
    options = _options(profile, ctx)
    best: dict[bool, UnitCost] = {}
    for styles in itertools.product(*options):
        runs = _runs(profile, tuple(styles), ctx)
        for output in ctx.output_layouts():
            if output is not model_output_layout(profile, styles, ctx):
                continue
            cost = evaluate_layout(profile, tuple(styles), output, ctx)
            if runs not in best or cost.time_s < best[runs].time_s - 1e-15:
                best[runs] = cost
    return best[True] if True in best else best[False]


def _solve_ilp(
    profile: UnitProfile,
    ctx: TPContext,
    options: list[tuple[TPStyle, ...]],
    outputs: tuple[Layout, ...],
    solver: str,
    *,
    param_cap: float | None = None,
) -> tuple[tuple[TPStyle, ...], Layout]:
    prog = Program("tp_layout")
    b = ctx.micro_batch
    x = {(i, s): prog.binary() for i, opts in enumerate(options) for s in opts}
    o = {lay: prog.binary() for lay in outputs}
    for i, opts in enumerate(options):
        prog.constrain({x[i, s]: 1.0 for s in opts}, lower=1.0, upper=1.0)
    prog.constrain({v: 1.0 for v in o.values()}, lower=1.0, upper=1.0)
    if len(o) > 1:  # the model's output is sharded exactly where a column leaf produces it
        for src in {f.src for f in profile.flows if f.dst == UNIT_OUTPUT}:
            if src != UNIT_INPUT and TPStyle.COLUMN in options[src]:
                prog.constrain({o[Layout.F]: 1.0, x[src, TPStyle.COLUMN]: -1.0}, lower=0.0, upper=0.0)
            else:
                prog.constrain({o[Layout.F]: 1.0}, lower=0.0, upper=0.0)

    def produces(node: int) -> list[tuple[Layout, dict[int, float]]]:
        """Each layout ``node`` may produce, and the sum of variables that is 1 when it does
        (empty: always)."""
        if node == UNIT_INPUT:
            return [(ctx.input_layout, {})]
        by_layout: dict[Layout, dict[int, float]] = {}
        for s in options[node]:
            by_layout.setdefault(STYLE_IO[s][1], {})[x[node, s]] = 1.0
        return list(by_layout.items())

    def needs(node: int) -> list[tuple[Layout, dict[int, float]]]:
        if node == UNIT_OUTPUT:
            return [(lay, {o[lay]: 1.0}) for lay in outputs]
        by_layout: dict[Layout, dict[int, float]] = {}
        for s in options[node]:
            by_layout.setdefault(STYLE_IO[s][0], {})[x[node, s]] = 1.0
        return list(by_layout.items())

    def at_least_both(var: int, a: dict[int, float], c: dict[int, float]) -> None:
        """``var >= a + c - 1`` for two indicator sums (an empty one is always 1)."""
        row = {var: 1.0}
        for part in (a, c):
            for v, coef in part.items():
                row[v] = row.get(v, 0.0) - coef
        prog.constrain(row, lower=(-1.0 if a and c else 0.0))

    for i, opts in enumerate(options):
        leaf = profile.leaves[i]
        for s in opts:
            prog.cost[x[i, s]] = (1 + BACKWARD_FACTOR) * leaf_fwd_s(leaf, s, ctx) + leaf_accumulate_s(leaf, s, ctx)
    if Layout.F in o and ctx.last:
        prog.cost[o[Layout.F]] += loss_parallel_s(ctx)
    conv: dict[tuple[int, Layout, Layout], int] = {}
    reduce_vars: dict[tuple[int, Layout], int] = {}
    largest = producer_bytes(profile)
    for flow in profile.flows:
        nbytes = largest[flow.src] * b
        for (a, xa), (need, xn) in itertools.product(produces(flow.src), needs(flow.dst)):
            glue = glue_step_s(flow, glue_layout(a, need, head_broadcast=flow.head_broadcast), ctx)
            if glue > 0:
                at_least_both(prog.var(cost=glue), xa, xn)
            f, bw = conversion_s(a, need, nbytes, ctx)
            if f + bw > 0:
                key = (flow.src, a, need)
                if key not in conv:
                    conv[key] = prog.var(cost=f + bw)
                at_least_both(conv[key], xa, xn)
        if flow.dst >= 0 and TPStyle.COLUMN in options[flow.dst]:
            for a, xa in produces(flow.src):
                cost = reduction_s(a, nbytes, ctx)
                if cost > 0:
                    key2 = (flow.src, a)
                    if key2 not in reduce_vars:
                        reduce_vars[key2] = prog.var(cost=cost)
                    at_least_both(reduce_vars[key2], xa, {x[flow.dst, TPStyle.COLUMN]: 1.0})
    if ctx.async_tp:
        _hide_fused(prog, profile, ctx, options, x, conv, reduce_vars)
    if param_cap is not None:
        params = {
            x[i, s]: leaf_param_numel(profile.leaves[i], s, ctx.tp, ctx.ep)
            for i, opts in enumerate(options)
            for s in opts
        }
        prog.constrain(params, upper=param_cap)
    prog.cost = [c * MICROSECONDS for c in prog.cost]  # HiGHS's absolute gap and tolerances are ~1e-6
    first: tuple[tuple[TPStyle, ...], Layout] | None = None
    for values, styles in _answers(prog, x, options, solver):
        found = styles, next(lay for lay in outputs if values[o[lay]] > 0.5)
        if _runs(profile, styles, ctx):
            return found
        first = first or found
    return first  # every layout was refused: the fastest


def _hide_fused(
    prog: Program,
    profile: UnitProfile,
    ctx: TPContext,
    options: list[tuple[TPStyle, ...]],
    x: dict[tuple[int, TPStyle], int],
    conv: dict[tuple[int, Layout, Layout], int],
    reduce_vars: dict[tuple[int, Layout], int],
) -> None:
    """Asynchronous TP's hidden time (:func:`autopar.cost.tensor_parallel.fused_hidden_s`)
    as variables the objective subtracts: each at most its collective's time where that
    collective is paid, and at most ``(tp - 1) / tp`` of the matmuls it fuses with where
    those leaves take the fusing style, so at the optimum each is the smaller bound. A
    reduce-scatter of input gradients hides only behind a single column-parallel reader:
    at most the collective times ``2 - readers``. Each bounds the transfer alone; a fused
    reduce-scatter also makes no copy, which a second variable takes back: at most the
    copy where the collective is paid and where any of those leaves fuses. In
    microseconds (:data:`MICROSECONDS`)."""
    k = (ctx.tp - 1) / ctx.tp
    column_mm, row_mm = matmul_s(profile, ctx, TPStyle.COLUMN), matmul_s(profile, ctx, TPStyle.ROW)
    readers = consumers(profile)
    largest = producer_bytes(profile)

    def hide(paid: int, transfer: float, behind: dict[int, float], copy: float) -> dict[int, float]:
        """The saved time's variables, in microseconds: the transfer's, the removed copy's."""
        h = prog.var(cost=-1.0 / MICROSECONDS)
        prog.constrain({h: 1.0, paid: -transfer * MICROSECONDS}, upper=0.0)
        prog.constrain({h: 1.0, **{v: -k * mm * MICROSECONDS for v, mm in behind.items()}}, upper=0.0)
        if copy <= 0:
            return {h: 1.0}
        c = prog.var(cost=-1.0 / MICROSECONDS)
        prog.constrain({c: 1.0, paid: -copy * MICROSECONDS}, upper=0.0)
        prog.constrain({c: 1.0, **dict.fromkeys(behind, -copy * MICROSECONDS)}, upper=0.0)
        return {h: 1.0, c: 1.0}

    def columns(src: int) -> dict[int, float]:
        return {x[d, TPStyle.COLUMN]: column_mm[d] for d in readers.get(src, ()) if TPStyle.COLUMN in options[d]}

    for (src, a, need), paid in conv.items():
        nbytes = largest[src] * ctx.micro_batch
        f, bw = transfer_s(a, need, nbytes, ctx)
        readers_mm = columns(src)
        if a is Layout.Q and need is Layout.R and readers_mm:
            hide(paid, f, readers_mm, 0.0)
        elif a is Layout.P and need is Layout.Q and src >= 0 and TPStyle.ROW in options[src]:
            row = {x[src, TPStyle.ROW]: row_mm[src]}
            hide(paid, f, row, conversion_copy_s(a, need, nbytes, ctx)[0])  # the reduce-scatter
            hide(paid, bw, row, 0.0)  # its backward all-gather
    for (src, a), paid in reduce_vars.items():
        readers_mm = columns(src)
        if a is Layout.Q and readers_mm:
            nbytes = largest[src] * ctx.micro_batch
            r, copy = reduction_s(a, nbytes, ctx), reduction_copy_s(a, nbytes, ctx)
            hidden = hide(paid, reduction_transfer_s(a, nbytes, ctx), readers_mm, copy)
            prog.constrain({**hidden, **dict.fromkeys(readers_mm, r * MICROSECONDS)}, upper=2 * r * MICROSECONDS)
