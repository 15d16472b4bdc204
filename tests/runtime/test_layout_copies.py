"""The copies torch's functional collectives make around sequence-parallel gathers and
scatters of the runtime's batch-first activations, counted on a real step against what
the cost model prices (:mod:`autopar.cost.layout_copies`). Run on a fake two-rank process
group in this process: collectives move nothing, but the reordering copies around them
run on real tensors."""

import dataclasses

import pytest
import torch
import torch._utils
import torch.distributed._functional_collectives as funcol
from parity import SEQ, batches, build, make_plan, megatron_styles, token_loss

from autopar.cost.model import CostModel, tp_context
from autopar.cost.tensor_parallel import evaluate_layout, model_output_layout
from autopar.graph import extract
from autopar.runtime.api import parallelize
from autopar.vocab import Optimizer, TPStyle

MICROBATCHES = 2


def _counting(monkeypatch) -> dict[str, int]:
    """Bytes the reordering copies write, forward and backward (run by an autograd node): the
    reduce-scatter's reorder of its input (funcol's own ``_chunk_or_narrow_cat``) and the
    all-gather's of its output (``torch._utils``'s, which ``_maybe_view_chunk_cat`` calls
    where a view will not do)."""
    written = {"forward": 0, "backward": 0}

    def wrap(original):
        def counted(tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            backward = torch._C._current_autograd_node() is not None
            written["backward" if backward else "forward"] += out.numel() * out.element_size()
            return out

        return counted

    monkeypatch.setattr(funcol, "_chunk_or_narrow_cat", wrap(funcol._chunk_or_narrow_cat))
    monkeypatch.setattr(torch._utils, "_chunk_or_narrow_cat", wrap(torch._utils._chunk_or_narrow_cat))
    return written


def _priced(plan) -> dict[str, float]:
    """What the cost model prices for those copies over the step: each unit's
    tensor-parallel time with the copies less without, in bytes written (a copy reads
    and writes its bytes)."""
    graph = extract(build("llama", "meta"), seq_len=SEQ, dtype="fp32")
    model = CostModel(graph=graph, cluster=plan.cluster, optimizer=Optimizer.ADAM, global_batch_size=1)
    priced = {"forward": 0.0, "backward": 0.0}
    for u, unit in enumerate(graph.units):
        profile = graph.profile_of(u)
        ctx = tp_context(model, u, plan.config)
        names = [f"{unit.prefix}.{leaf.name}" if unit.prefix else leaf.name for leaf in profile.leaves]
        styles = tuple(TPStyle(plan.layer_strategies.tp.get(n, "replicate")) for n in names)
        output = model_output_layout(profile, styles, ctx)
        copies = evaluate_layout(profile, styles, output, ctx)
        none = evaluate_layout(profile, styles, output, dataclasses.replace(ctx, batch_first=False))
        per_byte = 2 / ctx.rates.bytes_per_s
        priced["forward"] += (copies.fwd_comm_s - none.fwd_comm_s) / per_byte * plan.config.num_microbatches
        priced["backward"] += (copies.bwd_comm_s - none.bwd_comm_s) / per_byte * plan.config.num_microbatches
    return priced


@pytest.mark.parametrize("mbs", [1, 2])
def test_the_copies_a_sequence_parallel_step_makes_are_the_ones_priced(fake_world, monkeypatch, mbs):
    """Llama with Megatron-LM's layout at tp=2 with sequence parallelism: every
    reduce-scatter (the embedding's, each block's two, and the column-parallel inputs'
    gradients) reorders its whole input, and the all-gathers (each block's two, the
    head's, and the row-parallel outputs' and the embedding's gradients) their whole
    output where a micro-batch holds two sequences, not one. The bytes match the
    model's exactly."""
    plan = make_plan(
        "llama",
        tp=2,
        sequence_parallel=True,
        micro_batch_size=mbs,
        num_microbatches=MICROBATCHES,
        styles=megatron_styles("llama", sequence_parallel=True),
    )
    job = parallelize(build("llama"), plan, loss_fn=token_loss, measure_memory=False)
    first, second = job.shard(batches("llama", 2, plan.config.global_batch_size))
    job.step(first)  # the first also infers the stage's shapes with a forward
    written = _counting(monkeypatch)
    job.step(second)
    priced = _priced(plan)
    assert written["forward"] > 0 and written["backward"] > 0
    assert written["forward"] == pytest.approx(priced["forward"], rel=1e-9)
    assert written["backward"] == pytest.approx(priced["backward"], rel=1e-9)
