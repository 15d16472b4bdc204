"""The intra-op ILP: a tensor-parallel style for every leaf of a unit.

As Alpa's intra-operator pass (Zheng et al. 2022, section 4), each leaf picks one style
(binary ``x[l, s]``), edges pay resharding costs that depend on the styles at both ends
(linearised with ``y >= x_a + x_b - 1``), and the objective is the unit's forward plus
backward time on one micro-batch. Unlike Alpa, a conversion is charged once per producer
and target layout however many consumers need it, and the partial input gradient of
column-parallel consumers once per producer (see :mod:`autopar.cost.tensor_parallel`,
whose :func:`evaluate_layout` is the reference this ILP is tested against).

Solved once per distinct unit structure, TP degree, boundary layout and micro-batch
size; a 96-block GPT needs three solves per configuration of those, not 96.
"""

from __future__ import annotations

import itertools
import pulp

from autopar.cost.tensor_parallel import (
    BACKWARD_FACTOR, STYLE_IO, Layout, TPContext, UnitCost, allowed_styles, conversion_s, evaluate_layout,
    glue_fwd_s, glue_layout, leaf_fwd_s, leaf_param_numel, loss_parallel_s, reduction_s,
)
from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT, UnitProfile
from autopar.search.ilp import make_solver, solve
from autopar.vocab import TPStyle


def best_layout(profile: UnitProfile, ctx: TPContext, *, solver: str = "highs") -> UnitCost:
    """The fastest layout of ``profile`` (forward plus backward of one micro-batch)."""
    options = [allowed_styles(leaf, ctx) for leaf in profile.leaves]
    outputs = ctx.output_layouts()
    if all(len(o) == 1 for o in options) and len(outputs) == 1:
        return evaluate_layout(profile, tuple(o[0] for o in options), outputs[0], ctx)
    styles, output = _solve_ilp(profile, ctx, options, outputs, solver)
    return evaluate_layout(profile, styles, output, ctx)


def smallest_layout(profile: UnitProfile, ctx: TPContext, *, solver: str = "highs") -> UnitCost:
    """The fastest layout among those holding the fewest parameters (two ILP solves:
    minimise parameters, then time with parameters capped at that minimum)."""
    options = [allowed_styles(leaf, ctx) for leaf in profile.leaves]
    outputs = ctx.output_layouts()
    if all(len(o) == 1 for o in options) and len(outputs) == 1:
        return evaluate_layout(profile, tuple(o[0] for o in options), outputs[0], ctx)
    styles, output = _solve_ilp(profile, ctx, options, outputs, solver, minimize_params=True)
    fewest = evaluate_layout(profile, styles, output, ctx).param_numel
    styles, output = _solve_ilp(profile, ctx, options, outputs, solver, param_cap=fewest * (1 + 1e-9) + 1e-6)
    return evaluate_layout(profile, styles, output, ctx)


def brute_force_layout(profile: UnitProfile, ctx: TPContext) -> UnitCost:
    """The fastest layout by enumerating every assignment (exponential: tests only)."""
    options = [allowed_styles(leaf, ctx) for leaf in profile.leaves]
    best: UnitCost | None = None
    for styles in itertools.product(*options):
        for output in ctx.output_layouts():
            cost = evaluate_layout(profile, tuple(styles), output, ctx)
            if best is None or cost.time_s < best.time_s - 1e-15:
                best = cost
    assert best is not None
    return best


def _solve_ilp(profile: UnitProfile, ctx: TPContext, options: list[tuple[TPStyle, ...]],
               outputs: tuple[Layout, ...], solver: str, *, minimize_params: bool = False,
               param_cap: float | None = None) -> tuple[tuple[TPStyle, ...], Layout]:
    prob = pulp.LpProblem("tp_layout", pulp.LpMinimize)
    b = ctx.micro_batch
    x = {(i, s): pulp.LpVariable(f"x_{i}_{s.value}", cat="Binary") for i, opts in enumerate(options) for s in opts}
    o = {lay: pulp.LpVariable(f"out_{lay.value}", cat="Binary") for lay in outputs}
    for i, opts in enumerate(options):
        prob += pulp.lpSum(x[i, s] for s in opts) == 1
    prob += pulp.lpSum(o.values()) == 1

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
            terms.append((1 + BACKWARD_FACTOR) * leaf_fwd_s(profile.leaves[i], s, ctx) * x[i, s])
    if Layout.F in o and ctx.last:
        terms.append(loss_parallel_s(ctx) * o[Layout.F])
    conv: dict[tuple[int, Layout, Layout], pulp.LpVariable] = {}
    reduce_vars: dict[tuple[int, Layout], pulp.LpVariable] = {}
    for k, flow in enumerate(profile.flows):
        nbytes = flow.tensor_bytes * b
        for (a, xa), (need, xn) in itertools.product(produces(flow.src), needs(flow.dst)):
            glue = (1 + BACKWARD_FACTOR) * glue_fwd_s(flow, glue_layout(a, need), ctx)
            if glue > 0:
                y = pulp.LpVariable(f"g_{k}_{a.value}{need.value}", lowBound=0)
                prob += y >= xa + xn - 1
                terms.append(glue * y)
            f, bw = conversion_s(a, need, nbytes, ctx)
            if f + bw > 0:
                key = (flow.src, a, need)
                if key not in conv:
                    conv[key] = pulp.LpVariable(f"c_{flow.src + 2}_{a.value}{need.value}", lowBound=0)
                    terms.append((f + bw) * conv[key])
                prob += conv[key] >= xa + xn - 1
        if flow.dst >= 0 and TPStyle.COLUMN in options[flow.dst]:
            for a, xa in produces(flow.src):
                cost = reduction_s(a, nbytes, ctx)
                if cost > 0:
                    key2 = (flow.src, a)
                    if key2 not in reduce_vars:
                        reduce_vars[key2] = pulp.LpVariable(f"r_{flow.src + 2}_{a.value}", lowBound=0)
                        terms.append(cost * reduce_vars[key2])
                    prob += reduce_vars[key2] >= xa + x[flow.dst, TPStyle.COLUMN] - 1
    params = pulp.lpSum(leaf_param_numel(profile.leaves[i], s, ctx.tp) * x[i, s]
                        for i, opts in enumerate(options) for s in opts)
    if param_cap is not None:
        prob += params <= param_cap
    prob += params if minimize_params else pulp.lpSum(terms)
    solve(prob, make_solver(solver))
    styles = tuple(next(s for s in opts if (x[i, s].value() or 0) > 0.5) for i, opts in enumerate(options))
    output = next(lay for lay in outputs if (o[lay].value() or 0) > 0.5)
    return styles, output
