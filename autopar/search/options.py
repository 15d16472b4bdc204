"""Per-unit options: a tensor-parallel layout and a recompute mode, priced.

For each unit the intra-op ILP gives up to two layouts: the fastest, and the fastest
among those holding the fewest parameters (they differ where sharding costs more
communication than it saves compute, e.g. a vocabulary-parallel embedding). Each layout
combines with each recompute mode:

- ``none``: keep every saved activation;
- ``selective``: drop the attention core's activations, recompute its forward in
  backward (Korthikanti et al. 2022, section 5);
- ``full``: keep only the unit's input, recompute its forward, TP collectives included
  (Chen et al. 2016), and hold its activations again during its backward. The loss is
  not rerun (``UnitCost.loss_fwd_compute_s``), and the rerun compute costs
  ``TPContext.recompute_fraction`` of the recorded one, which a layer profile measures.

The stage solver then picks one option per unit under the stage's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.tensor_parallel import TPContext, UnitCost
from autopar.graph.layer_graph import UNIT_OUTPUT, UnitProfile
from autopar.search.intra_op import LayoutSolver
from autopar.vocab import Recompute


@dataclass(frozen=True, kw_only=True)
class UnitOption:
    """One way to run one unit, per micro-batch on one device.

    Attributes:
        layout: the TP layout and its costs.
        recompute: the recompute mode.
        fwd_s: forward time (compute and TP communication).
        bwd_s: backward time, recomputation included.
        recompute_s: the recomputation part of ``bwd_s``.
        act_bytes: activations kept per in-flight micro-batch.
        transient_bytes: extra memory while this unit runs its backward.
        recompute_flops: FLOPs recomputed per sample (for HFU).
    """

    layout: UnitCost
    recompute: Recompute
    fwd_s: float
    bwd_s: float
    recompute_s: float
    act_bytes: float
    transient_bytes: float
    recompute_flops: float

    @property
    def time_s(self) -> float:
        """Forward plus backward."""
        return self.fwd_s + self.bwd_s

    @property
    def tp_comm_s(self) -> float:
        """Tensor-parallel communication (forward, backward and recomputed forward)."""
        extra = self.layout.fwd_comm_s - self.layout.loss_fwd_comm_s if self.recompute is Recompute.FULL else 0.0
        return self.layout.fwd_comm_s + self.layout.bwd_comm_s + extra

    @property
    def syncs(self) -> int:
        """Blocking tensor-parallel collectives (forward, backward and recomputed forward)."""
        extra = self.layout.fwd_syncs - self.layout.loss_fwd_syncs if self.recompute is Recompute.FULL else 0
        return self.layout.fwd_syncs + self.layout.bwd_syncs + extra


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
    attn_flops = sum(f.attn_flops for f in profile.flows)
    loss_flops = sum(f.glue_flops for f in profile.flows if f.dst == UNIT_OUTPUT) if ctx.last else 0.0
    for lay in layouts(profile, ctx, solver):
        for mode in recompute_modes:
            if mode is Recompute.SELECTIVE and not profile.has_attention:
                continue
            found.append(make_option(lay, mode, profile.fwd_flops - loss_flops, attn_flops, ctx.recompute_fraction))
    if not found:  # a unit without attention when only selective was allowed: keep nothing
        for lay in layouts(profile, ctx, solver):
            found.append(
                make_option(lay, Recompute.NONE, profile.fwd_flops - loss_flops, attn_flops, ctx.recompute_fraction)
            )
    return tuple(o for o in found if not any(_dominates(p, o) for p in found if p is not o))


def make_option(
    lay: UnitCost, mode: Recompute, rerun_flops: float, attn_flops: float, recompute_fraction: float
) -> UnitOption:
    """Price one (layout, recompute) pair; full recomputation reruns the forward but
    the loss, its compute at ``recompute_fraction`` of the recorded time, its TP
    collectives whole."""
    full_act = lay.saved_bytes + lay.attn_saved_bytes
    if mode is Recompute.NONE:
        act, transient, redo, flops = full_act, lay.working_bytes, 0.0, 0.0
    elif mode is Recompute.SELECTIVE:
        act, transient, redo, flops = (
            lay.saved_bytes,
            lay.attn_saved_bytes + lay.working_bytes,
            lay.attn_fwd_s,
            attn_flops,
        )
    else:
        redo = recompute_fraction * (lay.fwd_compute_s - lay.loss_fwd_compute_s) + lay.fwd_comm_s - lay.loss_fwd_comm_s
        # the loss runs outside the checkpoint: what it keeps stays an activation
        act, flops = lay.input_bytes + lay.loss_saved_bytes, rerun_flops
        transient = full_act - lay.loss_saved_bytes + lay.working_bytes
    return UnitOption(
        layout=lay,
        recompute=mode,
        fwd_s=lay.fwd_s,
        bwd_s=lay.bwd_compute_s + lay.bwd_comm_s + redo,
        recompute_s=redo,
        act_bytes=act,
        transient_bytes=transient,
        recompute_flops=flops,
    )


def _dominates(p: UnitOption, o: UnitOption) -> bool:
    """``p`` is no worse than ``o`` in every respect (between equal options the one with
    less recomputation is kept)."""
    keys_p = (p.time_s, p.act_bytes, p.transient_bytes, p.layout.param_numel)
    keys_o = (o.time_s, o.act_bytes, o.transient_bytes, o.layout.param_numel)
    if keys_p == keys_o:
        return list(Recompute).index(p.recompute) < list(Recompute).index(o.recompute)
    return all(a <= b for a, b in zip(keys_p, keys_o))
