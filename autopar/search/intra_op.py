"""The intra-op ILP: a tensor-parallel style for every leaf of a unit.

As Alpa's intra-operator pass (Zheng et al. 2022, section 4), each leaf picks one style
(binary ``x[l, s]``), edges pay resharding costs that depend on the styles at both ends
(linearised with ``y >= x_a + x_b - 1``), and the objective is the unit's forward plus
backward time on one micro-batch. Unlike Alpa, a conversion is charged once per producer
and target layout however many consumers need it, and the partial input gradient of
column-parallel consumers once per producer (see :mod:`autopar.cost.tensor_parallel`,
whose :func:`evaluate_layout` is the reference this ILP is tested against).

Solved once per distinct unit structure, TP degree and boundary layout (and, only
where the costs are not affine in it, micro-batch size); a 96-block GPT needs one block
solve per such configuration, not 96.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pulp

from autopar.cost.tensor_parallel import (
    BACKWARD_FACTOR,
    STYLE_IO,
    Layout,
    TPContext,
    UnitCost,
    allowed_styles,
    conversion_s,
    evaluate_layout,
    glue_fwd_s,
    glue_layout,
    leaf_accumulate_s,
    leaf_fwd_s,
    leaf_param_numel,
    loss_parallel_s,
    model_output_layout,
    producer_bytes,
    reduction_s,
)
from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT, UnitProfile
from autopar.search.ilp import make_solver, solve
from autopar.vocab import TPStyle

ENUMERATE_LIMIT = 64
"""Layout spaces up to this size are enumerated (exactly, like the ILP) instead of solved:
a two-leaf embedding unit is cheaper to enumerate than to hand to a solver."""


class LayoutSolver:
    """Finds, and caches, the fastest layout and the fastest of the smallest layouts of
    each unit structure.

    Without measured matmul curves a layout's time is affine in the micro-batch size
    ``b`` (roofline terms scale with ``b``; collective latencies do not), so the best time
    over layouts is concave in ``b``: a layout optimal at the smallest and the largest
    ``b`` of the search is optimal at every ``b`` between them, and two solves serve all
    micro-batch sizes.
    """

    def __init__(self, *, solver: str = "highs", micro_batches: tuple[int, ...] = ()):
        self._solver = make_solver(solver)
        self._ends = (min(micro_batches), max(micro_batches)) if micro_batches else ()
        self._cache: dict[tuple, tuple[tuple[TPStyle, ...], Layout]] = {}
        self.solves = 0

    def fastest(self, profile: UnitProfile, ctx: TPContext) -> UnitCost:
        """The fastest layout (forward plus backward of one micro-batch)."""
        return self._layout(profile, ctx, small=False)

    def smallest(self, profile: UnitProfile, ctx: TPContext) -> UnitCost:
        """The fastest among the layouts holding the fewest parameters (often the
        fastest layout itself, which then needs no second solve)."""
        fast = self._layout(profile, ctx, small=False)
        if fast.param_numel <= self._fewest(profile, ctx):
            return fast
        return self._layout(profile, ctx, small=True)

    @staticmethod
    def _fewest(profile: UnitProfile, ctx: TPContext) -> float:
        """The fewest parameters any layout holds: separable per leaf."""
        return (
            sum(min(leaf_param_numel(leaf, s, ctx.tp) for s in allowed_styles(leaf, ctx)) for leaf in profile.leaves)
            * (1 + 1e-9)
            + 1e-6
        )

    def _layout(self, profile: UnitProfile, ctx: TPContext, *, small: bool) -> UnitCost:
        options = [allowed_styles(leaf, ctx) for leaf in profile.leaves]
        outputs = ctx.output_layouts()
        cap = self._fewest(profile, ctx) if small else None
        key = (id(profile), ctx.tp, ctx.sequence_parallel, ctx.first, ctx.last, ctx.boundary, ctx.rates, small)
        b = ctx.micro_batch
        affine = not ctx.rates.curve
        if affine and self._ends and self._ends[0] <= b <= self._ends[1]:
            lo = self._styles(profile, replace(ctx, micro_batch=self._ends[0]), options, outputs, cap, key)
            hi = self._styles(profile, replace(ctx, micro_batch=self._ends[1]), options, outputs, cap, key)
            if lo == hi:
                return evaluate_layout(profile, lo[0], lo[1], ctx)
        styles, output = self._styles(profile, ctx, options, outputs, cap, key)
        return evaluate_layout(profile, styles, output, ctx)

    def _styles(self, profile, ctx, options, outputs, cap, key) -> tuple[tuple[TPStyle, ...], Layout]:
        full_key = (*key, ctx.micro_batch)
        if full_key not in self._cache:
            size = len(outputs)
            for o in options:
                size *= len(o)
            if size <= ENUMERATE_LIMIT:
                self._cache[full_key] = _enumerate(profile, ctx, options, outputs, cap)
            else:
                self.solves += 1
                self._cache[full_key] = _solve_ilp(profile, ctx, options, outputs, self._solver, param_cap=cap)
        return self._cache[full_key]


def _enumerate(profile, ctx, options, outputs, cap) -> tuple[tuple[TPStyle, ...], Layout]:
    best, best_t = None, None
    for styles in itertools.product(*options):
        for output in outputs:
            if output is not model_output_layout(profile, styles, ctx):
                continue
            cost = evaluate_layout(profile, tuple(styles), output, ctx)
            if cap is not None and cost.param_numel > cap:
                continue
            if best_t is None or cost.time_s < best_t - 1e-15:
                best, best_t = (tuple(styles), output), cost.time_s
    assert best is not None, "the replicate layout always qualifies"
    return best


def brute_force_layout(profile: UnitProfile, ctx: TPContext) -> UnitCost:
    """The fastest layout by enumerating every assignment (exponential: tests only)."""
    options = [allowed_styles(leaf, ctx) for leaf in profile.leaves]
    best: UnitCost | None = None
    for styles in itertools.product(*options):
        for output in ctx.output_layouts():
            if output is not model_output_layout(profile, styles, ctx):
                continue
            cost = evaluate_layout(profile, tuple(styles), output, ctx)
            if best is None or cost.time_s < best.time_s - 1e-15:
                best = cost
    assert best is not None
    return best


def _solve_ilp(
    profile: UnitProfile,
    ctx: TPContext,
    options: list[tuple[TPStyle, ...]],
    outputs: tuple[Layout, ...],
    solver: pulp.LpSolver,
    *,
    param_cap: float | None = None,
) -> tuple[tuple[TPStyle, ...], Layout]:
    prob = pulp.LpProblem("tp_layout", pulp.LpMinimize)
    b = ctx.micro_batch
    x = {(i, s): prob.add_variable(f"x_{i}_{s.value}", cat="Binary") for i, opts in enumerate(options) for s in opts}
    o = {lay: prob.add_variable(f"out_{lay.value}", cat="Binary") for lay in outputs}
    for i, opts in enumerate(options):
        prob += pulp.lpSum(x[i, s] for s in opts) == 1
    prob += pulp.lpSum(o.values()) == 1
    if len(o) > 1:  # the model's output is sharded exactly where a column leaf produces it
        for src in {f.src for f in profile.flows if f.dst == UNIT_OUTPUT}:
            prob += o[Layout.F] == (
                x[src, TPStyle.COLUMN] if src != UNIT_INPUT and TPStyle.COLUMN in options[src] else 0
            )

    def produces(node: int) -> list[tuple[Layout, pulp.LpAffineExpression | int]]:
        if node == UNIT_INPUT:
            return [(ctx.input_layout, 1)]
        by_layout: dict[Layout, list] = {}
        for s in options[node]:
            by_layout.setdefault(STYLE_IO[s][1], []).append(x[node, s])
        return [(lay, pulp.lpSum(v)) for lay, v in by_layout.items()]

    def needs(node: int) -> list[tuple[Layout, pulp.LpAffineExpression]]:
        if node == UNIT_OUTPUT:
            return [(lay, o[lay]) for lay in outputs]
        by_layout: dict[Layout, list] = {}
        for s in options[node]:
            by_layout.setdefault(STYLE_IO[s][0], []).append(x[node, s])
        return [(lay, pulp.lpSum(v)) for lay, v in by_layout.items()]

    terms = []
    for i, opts in enumerate(options):
        for s in opts:
            leaf = profile.leaves[i]
            step = (1 + BACKWARD_FACTOR) * leaf_fwd_s(leaf, s, ctx) + leaf_accumulate_s(leaf, s, ctx)
            terms.append(step * x[i, s])
    if Layout.F in o and ctx.last:
        terms.append(loss_parallel_s(ctx) * o[Layout.F])
    conv: dict[tuple[int, Layout, Layout], pulp.LpVariable] = {}
    reduce_vars: dict[tuple[int, Layout], pulp.LpVariable] = {}
    largest = producer_bytes(profile)
    for k, flow in enumerate(profile.flows):
        nbytes = largest[flow.src] * b
        for (a, xa), (need, xn) in itertools.product(produces(flow.src), needs(flow.dst)):
            glue = (1 + BACKWARD_FACTOR) * glue_fwd_s(flow, glue_layout(a, need), ctx)
            if glue > 0:
                y = prob.add_variable(f"g_{k}_{a.value}{need.value}", lowBound=0)
                prob += y >= xa + xn - 1
                terms.append(glue * y)
            f, bw = conversion_s(a, need, nbytes, ctx)
            if f + bw > 0:
                key = (flow.src, a, need)
                if key not in conv:
                    conv[key] = prob.add_variable(f"c_{flow.src + 2}_{a.value}{need.value}", lowBound=0)
                    terms.append((f + bw) * conv[key])
                prob += conv[key] >= xa + xn - 1
        if flow.dst >= 0 and TPStyle.COLUMN in options[flow.dst]:
            for a, xa in produces(flow.src):
                cost = reduction_s(a, nbytes, ctx)
                if cost > 0:
                    key2 = (flow.src, a)
                    if key2 not in reduce_vars:
                        reduce_vars[key2] = prob.add_variable(f"r_{flow.src + 2}_{a.value}", lowBound=0)
                        terms.append(cost * reduce_vars[key2])
                    prob += reduce_vars[key2] >= xa + x[flow.dst, TPStyle.COLUMN] - 1
    params = pulp.lpSum(
        leaf_param_numel(profile.leaves[i], s, ctx.tp) * x[i, s] for i, opts in enumerate(options) for s in opts
    )
    if param_cap is not None:
        prob += params <= param_cap
    prob += pulp.lpSum(terms)
    solve(prob, solver)
    styles = tuple(next(s for s in opts if (x[i, s].value() or 0) > 0.5) for i, opts in enumerate(options))
    output = next(lay for lay in outputs if (o[lay].value() or 0) > 0.5)
    return styles, output
