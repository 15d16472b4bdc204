"""The output gradients a split backward keeps from a micro-batch's input-gradient step to
its weight-gradient step (torch's ``stage_backward_input`` saves them where a weight's
path meets the input's): traced per leaf, shaped by each tensor-parallel style, by hand."""

import pytest
import torch

import autopar
from autopar.cost.model import CostModel, tp_context
from autopar.cost.tensor_parallel import evaluate_layout
from autopar.graph import extract
from autopar.models import GPT, GPTConfig
from autopar.plan import ParallelConfig
from autopar.vocab import Layout, Optimizer, TPStyle

CFG = GPTConfig(vocab_size=512, seq_len=64, dim=128, n_layers=2, n_heads=4)


def _graph():
    with torch.device("meta"):
        return extract(GPT(CFG), seq_len=CFG.seq_len, dtype="bf16")


def test_each_weighted_op_leaves_its_output():
    """Per sample: a linear (bias added in the same ``addmm``) and a layer norm each leave
    their output, ``features x tokens x 2`` bytes in bf16; an embedding looks up rows by
    integer ids, which carry no gradient, and leaves none."""
    graph = _graph()
    tokens, itemsize = CFG.seq_len, 2
    for unit in range(len(graph.units)):
        for leaf in graph.profile_of(unit).leaves:
            width = {"embedding": 0}.get(leaf.kind.value, leaf.out_features or CFG.dim)
            assert leaf.weighted_out_bytes == width * tokens * itemsize, leaf.name


def test_a_layout_keeps_each_output_as_its_style_leaves_it():
    """Under tp=2 with sequence parallelism a block keeps its norms' outputs as sequence
    shards, its column-parallel projections' as feature shards and its row-parallel
    ones' partial sums whole, per micro-batch (of 4 samples)."""
    graph = _graph()
    cluster = autopar.preset("dgx-h100", nodes=1)
    model = CostModel(graph=graph, cluster=cluster, optimizer=Optimizer.ADAM, global_batch_size=8)
    config = ParallelConfig(dp=4, tp=2, pp=1, micro_batch_size=4, num_microbatches=1, sequence_parallel=True)
    block = 1
    profile = graph.profile_of(block)
    style = {"norm": TPStyle.SEQUENCE, "wo": TPStyle.ROW, "w2": TPStyle.ROW}
    styles = tuple(style.get(leaf.name.rsplit(".", 1)[-1].split("_")[-1], TPStyle.COLUMN) for leaf in profile.leaves)
    assert styles.count(TPStyle.SEQUENCE) == 2 and styles.count(TPStyle.ROW) == 2
    cost = evaluate_layout(profile, styles, Layout.Q, tp_context(model, block, config))
    d, samples = CFG.dim, 4 * CFG.seq_len * 2
    by_hand = samples * (2 * d / 2 + 3 * d / 2 + d + 4 * d / 2 + d)
    assert cost.wait_bytes == pytest.approx(by_hand)
