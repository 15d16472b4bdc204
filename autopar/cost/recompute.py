"""Recompute modes, priced: one unit's layout under ``none``, ``selective``, ``op`` or
``full`` activation recomputation.

- ``none``: keep every saved activation;
- ``selective``: drop the attention core's activations, recompute its forward in
  backward (Korthikanti et al. 2022, section 5); its output stays, kept by the output
  projection, and is made again by the rerun core;
- ``op``: keep the unit's input and the outputs of the operators torchtitan's
  per-operator policy saves (:mod:`autopar.cost.saved_ops`), rerun the rest of the
  forward, its collectives but the kept reduce-scatters included, as ``full`` does;
  during the unit's backward the rerun forward's activations are held as under
  ``full`` (an upper bound: a kept output that autograd also saves is counted twice
  there);
- ``full``: keep only the unit's input, recompute its forward, TP collectives included
  (Chen et al. 2016), and hold its activations again during its backward. The loss is
  not rerun (the runtime checkpoints the unit's modules and the loss runs outside
  them: ``UnitCost.loss_fwd_compute_s``), and the rerun compute costs a
  ``recompute_fraction`` of the recorded one, which a layer profile measures.

Where the plan keeps the shards of its sequence-parallel gathers (``regather``), the
modes that keep activations (``none``, ``selective``) keep the shards and gather again
in the backward (:mod:`autopar.cost.regather`); a checkpoint keeps its own.

Under context parallelism every recomputing mode reruns the attention core's key/value
exchange (:mod:`autopar.cost.context_parallel`; ``op`` keeps the attention's output but
not the exchange's collectives); ``op`` and ``full`` rerun the forward all-to-alls of
expert parallelism (:mod:`autopar.cost.expert_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.context_parallel import NO_EXCHANGE, RingExchange, ring_exchange
from autopar.cost.expert_parallel import NO_ALL_TO_ALL, ExpertExchange, expert_exchange
from autopar.cost.leaf import TPContext
from autopar.cost.saved_ops import kept_flops
from autopar.cost.tensor_parallel import UnitCost
from autopar.graph.layer_graph import UNIT_OUTPUT, UnitProfile
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
        cp_comm_s: context-parallel exchange not hidden by attention, forward and
            backward (included in ``fwd_s`` and ``bwd_s``; a recomputed forward's is
            part of ``recompute_s``).
        ep_comm_s: expert parallelism's all-to-alls, forward and backward (included in
            ``fwd_s`` and ``bwd_s``; a recomputed forward's is part of ``recompute_s``).
    """

    layout: UnitCost
    recompute: Recompute
    fwd_s: float
    bwd_s: float
    recompute_s: float
    act_bytes: float
    transient_bytes: float
    recompute_flops: float
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0

    @property
    def time_s(self) -> float:
        """Forward plus backward."""
        return self.fwd_s + self.bwd_s

    @property
    def tp_comm_s(self) -> float:
        """Tensor-parallel communication (forward, backward and recomputed forward)."""
        lay = self.layout
        return lay.fwd_comm_s + lay.bwd_comm_s + rerun_comm(lay, self.recompute)[0] + regathered(lay, self.recompute)[0]

    @property
    def syncs(self) -> int:
        """Blocking tensor-parallel collectives (forward, backward and recomputed forward)."""
        lay = self.layout
        return lay.fwd_syncs + lay.bwd_syncs + rerun_comm(lay, self.recompute)[1] + regathered(lay, self.recompute)[1]


def regathered(lay: UnitCost, mode: Recompute) -> tuple[float, int]:
    """Seconds and blocking collectives of the backward's all-gathers of kept shards
    (:mod:`autopar.cost.regather`): only where ``mode`` keeps activations; a checkpoint
    keeps its own."""
    if mode.checkpoints_unit:
        return 0.0, 0
    return lay.regather.backward_s, lay.regather.syncs


def rerun_comm(lay: UnitCost, mode: Recompute) -> tuple[float, int]:
    """Seconds and blocking collectives of the tensor-parallel forward communication
    that ``mode`` reruns in backward: none but under ``op`` and ``full``, which rerun
    the forward's but the loss's (and, under ``op``, but the kept reduce-scatters)."""
    if not mode.checkpoints_unit:
        return 0.0, 0
    seconds, syncs = lay.fwd_comm_s - lay.loss_fwd_comm_s, lay.fwd_syncs - lay.loss_fwd_syncs
    if mode is Recompute.OP:
        seconds, syncs = seconds - lay.op_kept_comm_s, syncs - lay.op_kept_syncs
    return seconds, syncs


def make_option(
    lay: UnitCost,
    mode: Recompute,
    rerun_flops: float,
    attn_flops: float,
    recompute_fraction: float,
    ring: RingExchange = NO_EXCHANGE,
    experts: ExpertExchange = NO_ALL_TO_ALL,
    kept_flops: float = 0.0,
) -> UnitOption:
    """Price one (layout, recompute) pair; full recomputation reruns the forward but
    the loss, its compute at ``recompute_fraction`` of the recorded time, its TP
    collectives and expert all-to-alls whole; ``op`` reruns the same less what it keeps
    (``kept_flops`` of ``rerun_flops``, the layout's ``op_kept_*``); every recomputing
    mode reruns the context-parallel exchange ``ring``."""
    full_act = lay.saved_bytes + lay.attn_saved_bytes
    if mode is Recompute.NONE:
        act, transient, redo, flops = full_act, lay.working_bytes, 0.0, 0.0
    elif mode is Recompute.SELECTIVE:
        act, transient, redo, flops = (
            lay.saved_bytes,
            lay.attn_saved_bytes + lay.attn_output_bytes + lay.working_bytes,
            lay.attn_fwd_s,
            attn_flops,
        )
    else:
        kept_s, kept_bytes = (lay.op_kept_compute_s, lay.op_kept_bytes) if mode is Recompute.OP else (0.0, 0.0)
        redo = recompute_fraction * (lay.fwd_compute_s - lay.loss_fwd_compute_s - kept_s) + rerun_comm(lay, mode)[0]
        # the loss runs outside the checkpoint: what it keeps stays an activation
        act = lay.input_bytes + lay.loss_saved_bytes + kept_bytes
        flops = rerun_flops - (kept_flops if mode is Recompute.OP else 0.0)
        transient = full_act - lay.loss_saved_bytes + lay.working_bytes
    if not mode.checkpoints_unit:  # the sequence-parallel gathers kept as shards, if the plan does
        act -= lay.regather.saved_bytes
        transient += lay.regather.held_bytes
    if mode is not Recompute.NONE:
        redo += ring.fwd_s
    if mode.checkpoints_unit:
        redo += experts.fwd_s
    return UnitOption(
        layout=lay,
        recompute=mode,
        fwd_s=lay.fwd_s + ring.fwd_s + experts.fwd_s,
        bwd_s=lay.bwd_compute_s + lay.bwd_comm_s + regathered(lay, mode)[0] + ring.bwd_s + experts.bwd_s + redo,
        recompute_s=redo,
        act_bytes=act,
        transient_bytes=transient + max(ring.transient_bytes, experts.transient_bytes),
        recompute_flops=flops,
        cp_comm_s=ring.fwd_s + ring.bwd_s,
        ep_comm_s=experts.fwd_s + experts.bwd_s,
    )


def price_option(profile: UnitProfile, layout: UnitCost, mode: Recompute, ctx: TPContext) -> UnitOption:
    """``layout`` of a unit of ``profile`` under recompute ``mode``: the FLOPs full
    recomputation reruns are the unit's forward less the loss's (the last unit's glue
    into its output), selective recomputation reruns the attention core's. Under context
    parallelism the attention's key/value exchange is priced on the layout's keys and
    values (:func:`autopar.cost.context_parallel.ring_exchange`); under expert
    parallelism its all-to-alls (:func:`autopar.cost.expert_parallel.expert_exchange`)."""
    attn_flops = sum(f.attn_flops for f in profile.flows)
    loss_flops = sum(f.glue_flops for f in profile.flows if f.dst == UNIT_OUTPUT) if ctx.last else 0.0
    ring = ring_exchange(layout.kv_bytes, layout.attn_fwd_s, ctx)
    experts = expert_exchange(profile, ctx)
    return make_option(
        layout,
        mode,
        profile.fwd_flops - loss_flops,
        attn_flops,
        ctx.recompute_fraction,
        ring,
        experts,
        kept_flops=kept_flops(profile),
    )
