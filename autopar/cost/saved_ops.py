"""What per-operator selective recomputation (``Recompute.OP``) keeps of a unit.

torchtitan's per-operator selective checkpointing (``activation_checkpoint.mode =
"selective"``, ``selective_ac_option = "op"``) checkpoints a unit and, inside it, keeps
the outputs of a short list of operators: every other ``aten.mm`` (the first, third,
...), the attention kernels and the sequence-parallel reduce-scatters. Everything else
(norms, activation functions, rotary embeddings, the other matmuls, every other
collective) is recomputed in backward from the unit's input and those outputs. The
policy trades the cheap elementwise work and half the matmuls for most of the
activation memory.

In the layer graph a kept matmul is a linear leaf without bias and without stacked
experts: a linear layer with a bias runs ``aten.addmm`` and stacked experts run grouped
matmuls, neither of which is on the list, so both are recomputed and do not advance the
count. The runtime applies the same rules (:mod:`autopar.runtime.recompute`).
"""

from __future__ import annotations

from autopar.graph.layer_graph import LeafKind, UnitProfile


def counted_matmuls(profile: UnitProfile) -> tuple[int, ...]:
    """Leaves (profile indices, execution order) whose forward is one ``aten.mm``: the
    linear layers without bias or stacked experts."""
    return tuple(
        i
        for i, leaf in enumerate(profile.leaves)
        if leaf.kind is LeafKind.LINEAR and leaf.param_numel == leaf.weight_numel and not leaf.experts
    )


def kept_matmuls(profile: UnitProfile) -> frozenset[int]:
    """Leaves whose matmul output the policy keeps: the first, third, fifth... of
    :func:`counted_matmuls`."""
    return frozenset(counted_matmuls(profile)[::2])


def kept_flops(profile: UnitProfile) -> float:
    """Forward FLOPs per sample the policy does not rerun: the kept matmuls and the
    attention cores."""
    kept = kept_matmuls(profile)
    return sum(leaf.fwd_flops for i, leaf in enumerate(profile.leaves) if i in kept) + sum(
        f.attn_flops for f in profile.flows
    )
