"""The output gradients a split backward keeps from a micro-batch's input-gradient step to
its weight-gradient step (torch's ``stage_backward_input`` saves them where a weight's
path meets the input's): traced per leaf, shaped by each tensor-parallel style, by hand;
how many micro-batches await where a rank holds the most, on torch's own orders."""

import pytest
import torch

import autopar
from autopar.cost.model import CostModel, tp_context
from autopar.cost.pipeline import inflight_microbatches, most_awaiting, schedule_problem, weight_wait_moment
from autopar.cost.tensor_parallel import evaluate_layout
from autopar.graph import extract
from autopar.models import GPT, GPTConfig
from autopar.plan import ParallelConfig
from autopar.vocab import Layout, Optimizer, Schedule, TPStyle

from .test_zero_bubble_cost import Kind, peak_chunks, torch_order

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


def moments(actions):
    """The (held, awaiting) pairs a rank passes through that no other pair it passes
    through holds as much of both: chunks held from forward to weight gradient, and of
    them those whose input gradient ran (the pipeline's first stage, whose backward
    torch runs whole at its ``W``, awaits nothing)."""
    held, awaiting, seen = set(), set(), set()
    for a in actions:
        key = (a.stage_index, a.microbatch_index)
        if a.computation_type is Kind.FORWARD:
            held.add(key)
        elif a.computation_type is Kind.BACKWARD_INPUT and a.stage_index:
            awaiting.add(key)
        elif a.computation_type in (Kind.BACKWARD_WEIGHT, Kind.FULL_BACKWARD):
            held.discard(key)
            awaiting.discard(key)
        seen.add((len(held), len(awaiting)))
    return {s for s in seen if not any(t != s and t[0] >= s[0] and t[1] >= s[1] for t in seen)}


@pytest.mark.parametrize("schedule", [Schedule.INTERLEAVED_ZB, Schedule.ZBV, Schedule.DUALPIPEV])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_weight_wait_moment_is_torch_order(schedule, p):
    """``weight_wait_moment`` is the moment of torch's order where the rank holds the
    most (as many as :func:`inflight_microbatches` counts), with as many awaiting their
    weight gradient as torch's order has there; for interleaved ZB it is the only moment
    no other covers. A V's drain holds fewer with more awaiting (ZB-V's last rank
    ``(2p - 1, 2p - 1)``), which the dry runs do not peak at
    (``tests/runtime/test_weight_wait_memory.py``)."""
    for m in range(1, 3 * p + 2):
        for v in (2, 3) if schedule is Schedule.INTERLEAVED_ZB else (2,):
            if schedule_problem(schedule, p, v, m):
                continue
            order = torch_order(schedule, p, v, m)
            for r in range(p):
                theirs, mine = moments(order[r]), weight_wait_moment(schedule, p, v, m, r)
                assert mine in theirs and mine[0] == max(a for a, _ in theirs) == peak_chunks(order[r]), (m, v, r)
                assert mine[0] == inflight_microbatches(schedule, p, v, m, r) * v, (m, v, r)
                if schedule is Schedule.INTERLEAVED_ZB:
                    assert {mine} == theirs, (m, v, r)
            if schedule is Schedule.ZBV and m >= 2 * p - 1:
                assert (2 * p - 1, 2 * p - 1) in moments(order[p - 1])
    assert most_awaiting(schedule, 8, 2, 24) == {Schedule.INTERLEAVED_ZB: 8, Schedule.ZBV: 1}.get(schedule, 0)
