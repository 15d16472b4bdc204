"""Per-unit options: the layouts worth keeping, each under each recompute mode.

For each unit the intra-op ILP gives up to two layouts: the fastest, and the fastest
among those holding the fewest parameters (they differ where sharding costs more
communication than it saves compute, e.g. a vocabulary-parallel embedding). Each layout
combines with each recompute mode (priced by :mod:`autopar.cost.recompute`), options
no better than another in every respect are dropped, and the stage solver picks one
option per unit under the stage's memory.
"""

from __future__ import annotations

from autopar.cost.leaf import TPContext
from autopar.cost.recompute import UnitOption, price_option
from autopar.cost.saved_ops import kept_matmuls
from autopar.cost.tensor_parallel import UnitCost
from autopar.graph.layer_graph import UnitProfile
from autopar.search.intra_op import LayoutSolver
from autopar.vocab import Recompute


def layouts(profile: UnitProfile, ctx: TPContext, solver: LayoutSolver) -> tuple[UnitCost, ...]:
    """The fastest layout and, if different, the fastest of the smallest."""
    fast = solver.fastest(profile, ctx)
    small = solver.smallest(profile, ctx)
    if small.styles == fast.styles and small.output == fast.output:
        return (fast,)
    return (fast, small)


def unit_options(
    profile: UnitProfile, ctx: TPContext, *, solver: LayoutSolver, recompute_modes: tuple[Recompute, ...]
) -> tuple[UnitOption, ...]:
    """Every (layout, recompute) option of a unit, dominated ones removed."""
    found: list[UnitOption] = []
    for lay in layouts(profile, ctx, solver):
        for mode in recompute_modes:
            if mode is Recompute.SELECTIVE and not profile.has_attention:
                continue
            if mode is Recompute.OP and not (kept_matmuls(profile) or profile.has_attention):
                continue  # keeps nothing but the input: full recomputation by another name
            found.append(price_option(profile, lay, mode, ctx))
    if not found:  # a unit without attention or matmuls when only those modes were allowed: no recomputation
        found = [price_option(profile, lay, Recompute.NONE, ctx) for lay in layouts(profile, ctx, solver)]
    return tuple(o for o in found if not any(_dominates(p, o) for p in found if p is not o))


def _dominates(p: UnitOption, o: UnitOption) -> bool:
    """``p`` is no worse than ``o`` in every respect (between equal options the one with
    less recomputation is kept)."""
    keys_p = (p.time_s, p.act_bytes, p.transient_bytes, p.layout.param_numel)
    keys_o = (o.time_s, o.act_bytes, o.transient_bytes, o.layout.param_numel)
    if keys_p == keys_o:
        return list(Recompute).index(p.recompute) < list(Recompute).index(o.recompute)
    return all(a <= b for a, b in zip(keys_p, keys_o))
