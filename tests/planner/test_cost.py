"""Cost-model terms against closed-form hand calculations."""

import math
from collections import Counter

import pytest

from autopar.cost.comm import all_gather_s, all_reduce_s, group_span, p2p_s
from autopar.cost.compute import ComputeRates, interpolate_loglog, rates, work_s
from autopar.cost.leaf import TPContext, padded
from autopar.cost.pipeline import inflight_microbatches, pipeline_time_s, schedule_problem, stage_buffer_bytes
from autopar.cost.tensor_parallel import evaluate_layout
from autopar.graph import extract
from autopar.hardware import preset
from autopar.models import build_named_model
from autopar.vocab import DType, Layout, Schedule, TPStyle

DGX = preset("dgx-a100-80gb", nodes=4)
BI, BE = DGX.intra_node.bandwidth_bytes_per_s, DGX.inter_node.bandwidth_bytes_per_s
AI, AE = DGX.intra_node.latency_s, DGX.inter_node.latency_s


def test_group_spans_follow_the_rank_layout():
    assert group_span(8, 1, 8) == group_span(8, 1, 8).__class__(size=8, per_node=8, nodes=1)
    dp = group_span(4, 8, 8)  # tp=8 fills a node: one dp rank per node
    assert (dp.per_node, dp.nodes) == (1, 4)
    dp = group_span(16, 2, 8)  # tp=2: four dp ranks per node
    assert (dp.per_node, dp.nodes) == (4, 4)
    tp = group_span(16, 1, 8)  # a TP group across two nodes
    assert (tp.per_node, tp.nodes) == (8, 2)


@pytest.mark.parametrize("devices_per_node", [2, 4, 6, 8, 16])
def test_a_group_span_is_the_slowest_group_of_the_whole_world(devices_per_node):
    """Against every group of an explicit world of whole nodes (each axis's groups tiling
    the ranks in blocks of size x stride): the span is the group with the fewest members
    on one node, then the most nodes. tp=6 on nodes of 8 puts ranks 6-11 on two nodes,
    2 and 4 of them, where the old rule saw one node."""
    for size in (2, 3, 4, 6, 8, 12, 16):
        for stride in (1, 2, 3, 4, 6, 8, 12, 16, 48):
            block = size * stride
            world = 2 * math.lcm(block, devices_per_node)
            worst = (size, -1)
            for base in (b for b in range(world) if b % block < stride):
                nodes = Counter((base + k * stride) // devices_per_node for k in range(size))
                worst = min(worst, (min(nodes.values()), -len(nodes)))
            span = group_span(size, stride, devices_per_node)
            assert (span.per_node, span.nodes) == (worst[0], -worst[1]), (size, stride, devices_per_node)
    six = group_span(6, 1, 8)
    assert (six.per_node, six.nodes) == (2, 2)


def test_ring_all_reduce_inside_a_node():
    size = 1e9
    assert all_reduce_s(size, group_span(8, 1, 8), DGX) == pytest.approx(2 * 7 / 8 * size / BI + 2 * 7 * AI)
    assert all_gather_s(size, group_span(8, 1, 8), DGX) == pytest.approx(7 / 8 * size / BI + 7 * AI)


def test_hierarchical_all_reduce_across_nodes():
    size = 1e9
    span = group_span(32, 1, 8)  # 8 per node x 4 nodes
    expected = 2 * 7 / 8 * size / BI + 2 * 7 * AI + 2 * 3 / 4 * (size / 8) / BE + 2 * 2 * AE
    assert all_reduce_s(size, span, DGX) == pytest.approx(expected)
    assert all_reduce_s(size, group_span(1, 1, 8), DGX) == 0.0
    assert p2p_s(1e6, cross_node=True, cluster=DGX) == pytest.approx(1e6 / BE + AE)


def test_roofline():
    r = ComputeRates(matmul_flops_per_s=100e12, vector_flops_per_s=10e12, bytes_per_s=1e12)
    assert work_s(matmul_flops=1e12, other_flops=0, nbytes=1e9, r=r) == pytest.approx(0.01)  # compute bound
    assert work_s(matmul_flops=1e9, other_flops=0, nbytes=1e10, r=r) == pytest.approx(0.01)  # memory bound
    curve = ((1e6, 1e12), (1e9, 1e14))
    assert interpolate_loglog(curve, 1e3) == 1e12 and interpolate_loglog(curve, 1e12) == 1e14
    assert interpolate_loglog(curve, math.sqrt(1e6 * 1e9)) == pytest.approx(1e13)


def test_pipeline_bubble_and_inflight():
    w = 1.0
    assert pipeline_time_s([w] * 4, 8, 1) == pytest.approx((8 + 4 - 1) * w)  # bubble (p-1)/m
    assert pipeline_time_s([2 * w] * 4, 8, 2) == pytest.approx((8 + 3 / 2) * 2 * w)  # interleaved: (p-1)/(v m)
    assert pipeline_time_s([1.0, 3.0], 4, 1) == pytest.approx(3 * 3.0 + 1.0 + 3.0)
    assert [inflight_microbatches(Schedule.ONE_F_ONE_B, 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert inflight_microbatches(Schedule.GPIPE, 4, 1, 8, 0) == 8
    # torch's interleaved warm-up: (v-1) * m_per_round + 2 (p-1-r) chunk forwards, then one more
    assert inflight_microbatches(Schedule.INTERLEAVED_1F1B, 4, 2, 8, 0) == (4 + 6 + 1) / 2
    assert schedule_problem(Schedule.ONE_F_ONE_B, 4, 1, 2) is not None


def test_a_pipeline_stage_holds_its_outputs_in_flight_and_one_message_on_its_way():
    """3 micro-batches in flight, boundary tensors of 1 (input) and 10 (output) bytes:
    a middle stage holds the 3 outputs kept for their backward, the gradient of one
    output being consumed and the gradient of one input on its way back; its inputs in
    flight are its first unit's saved inputs (counted with the activations). The first
    stage receives nothing, the last sends nothing. Nothing depends on the micro-batch
    count: the runtime allocates a receive buffer only when the receive is posted."""

    def held(receives, sends, inflight=3.0):
        return stage_buffer_bytes(
            receives_input=receives, sends_output=sends, input_bytes=1.0, output_bytes=10.0, inflight=inflight
        )

    assert held(True, True) == 1 + (3 + 1) * 10
    assert held(False, True) == (3 + 1) * 10
    assert held(True, False) == 1
    assert held(False, False) == 0.0
    # GPipe: every micro-batch in flight
    assert held(True, True, inflight=8.0) == 1 + (8 + 1) * 10


def test_megatron_block_communication_and_memory():
    """A GPT block at tp=t: two all-reduces forward and two backward of b s h bytes
    (Shoeybi et al. 2019); with sequence parallelism two all-gathers and two
    reduce-scatters each way, and activations divided by t (Korthikanti et al. 2022). On
    the runtime's batch-first activations each reduce-scatter also copies its whole input
    (torch puts the sequence chunks first for NCCL); a micro-batch of one sequence
    gathers without a copy. Megatron-LM's sequence-first layout copies nothing."""
    graph = extract(build_named_model("gpt3-6.7b"), seq_len=2048, attention="flash")
    block = graph.profile_of(1)
    t, b, s, h = 8, 1, 2048, 4096
    x = b * s * h * 2
    span = group_span(t, 1, 8)
    styles = {
        "attention_norm": TPStyle.REPLICATE,
        "ffn_norm": TPStyle.REPLICATE,
        "attention.wo": TPStyle.ROW,
        "feed_forward.w2": TPStyle.ROW,
    }
    chosen = tuple(styles.get(leaf.name, TPStyle.COLUMN) for leaf in block.leaves)
    ctx = TPContext(
        tp=t,
        span=span,
        cluster=DGX,
        rates=rates(DGX.device, DType.BF16),
        micro_batch=b,
        tokens=s,
        boundary=Layout.R,
        first=False,
        last=False,
        loss_parallel=False,
        sequence_parallel=False,
    )
    cost = evaluate_layout(block, chosen, Layout.R, ctx)
    assert cost.fwd_comm_s == pytest.approx(2 * all_reduce_s(x, span, DGX))
    assert cost.bwd_comm_s == pytest.approx(2 * all_reduce_s(x, span, DGX))
    assert (cost.fwd_syncs, cost.bwd_syncs) == (2, 2)
    sp_styles = tuple(TPStyle.SEQUENCE if leaf.name.endswith("norm") else s for leaf, s in zip(block.leaves, chosen))
    sp_ctx = TPContext(**{**ctx.__dict__, "boundary": Layout.Q, "sequence_parallel": True})
    sp = evaluate_layout(block, sp_styles, Layout.Q, sp_ctx)
    copy = 2 * x / DGX.device.roofline.memory_bandwidth_bytes_per_s / DGX.device.roofline.memory_efficiency
    assert sp.fwd_comm_s == pytest.approx(4 * all_gather_s(x, span, DGX) + 2 * copy)
    assert sp.bwd_comm_s == pytest.approx(4 * all_gather_s(x, span, DGX) + 2 * copy)
    assert (sp.fwd_syncs, sp.bwd_syncs) == (4, 4)
    megatron = evaluate_layout(block, sp_styles, Layout.Q, TPContext(**{**sp_ctx.__dict__, "batch_first": False}))
    assert megatron.fwd_comm_s == pytest.approx(4 * all_gather_s(x, span, DGX))
    assert megatron.bwd_comm_s == pytest.approx(4 * all_gather_s(x, span, DGX))
    full = evaluate_layout(
        block,
        (TPStyle.REPLICATE,) * len(block.leaves),
        Layout.R,
        TPContext(**{**ctx.__dict__, "tp": 1, "span": group_span(1, 1, 8)}),
    )
    assert (full.fwd_syncs, full.bwd_syncs) == (0, 0)
    # With SP everything is divided by t except the inputs of the two column-parallel
    # groups (q/k/v and w1): DTensor saves the all-gathered input, where Megatron-LM
    # keeps the shard and gathers again in backward (Korthikanti et al. 2022, 4.2.2).
    gathered = 2 * x
    whole = full.saved_bytes + full.attn_saved_bytes
    assert sp.saved_bytes + sp.attn_saved_bytes == pytest.approx((whole - gathered) / t + gathered, rel=1e-9)
    assert cost.saved_bytes + cost.attn_saved_bytes > sp.saved_bytes + sp.attn_saved_bytes
    # 12 h^2 weights sharded; the two norms (4h) and the biases (q, k, v, o: 4h; w1: 4h;
    # w2: h) charged replicated, 13h in all (a column split's bias is one vector,
    # counted as replicated: graph.units.matrix_shape)
    assert block.param_numel == 12 * h * h + 13 * h
    assert cost.param_numel == pytest.approx(12 * h * h / t + 13 * h, rel=1e-12)


def test_megatron_vocabulary_padding():
    assert padded(50257, 8) == 51200 and padded(51200, 8) == 51200


def test_a_collective_split_into_calls_pays_the_latency_per_call():
    span = group_span(8, 1, 8)
    one = all_gather_s(1e6, span, DGX)
    assert all_gather_s(1e6, span, DGX, calls=5) == pytest.approx(one + 4 * 7 * AI)
    assert all_reduce_s(1e6, span, DGX, calls=3) == pytest.approx(all_reduce_s(1e6, span, DGX) + 2 * 2 * 7 * AI)


def test_a_measured_curve_prices_its_collective_on_groups_of_its_size():
    """Where a level has a measured curve for a collective on groups of ``n`` ranks, a
    group of ``n`` pays ``calls`` calls of ``S / calls`` on the curve (past the largest
    size, the fit's bandwidth per extra byte); other group sizes keep the alpha-beta
    line. Hand values on a 4-point curve."""
    import dataclasses

    from autopar.hardware import CommCurve, OpLink

    curve = CommCurve(ranks=8, nbytes=(1e3, 1e6, 1e7, 1e8), time_s=(1e-4, 1e-3, 4e-3, 2e-2))
    fit = OpLink(op="all_reduce", bandwidth_bytes_per_s=BI, latency_s=AI, curve=curve)
    send = OpLink(
        op="send_recv",
        bandwidth_bytes_per_s=BE,
        latency_s=AE,
        curve=CommCurve(ranks=2, nbytes=(1e3, 1e6), time_s=(5e-5, 2e-4)),
    )
    c = dataclasses.replace(
        DGX,
        intra_node=dataclasses.replace(DGX.intra_node, per_op=(fit,)),
        inter_node=dataclasses.replace(DGX.inter_node, per_op=(send,)),
    )
    node = group_span(8, 1, 8)
    assert all_reduce_s(5.5e6, node, c) == pytest.approx(1e-3 + 0.5 * 3e-3)  # halfway from 1 to 10 MB
    assert all_reduce_s(5.5e6, node, c, calls=10) == pytest.approx(10 * (1e-4 + (5.5e5 - 1e3) / (1e6 - 1e3) * 9e-4))
    assert all_reduce_s(5e2, node, c) == pytest.approx(1e-4)  # below: the smallest size's
    assert all_reduce_s(3e8, node, c) == pytest.approx(2e-2 + 2 * 7 / 8 * 2e8 / BI)  # past: the fit's slope
    four = group_span(4, 1, 8)
    assert all_reduce_s(1e6, four, c) == pytest.approx(2 * 3 / 4 * 1e6 / BI + 2 * 3 * AI)  # no curve for 4 ranks
    assert all_gather_s(1e6, node, c) == pytest.approx(7 / 8 * 1e6 / BI + 7 * AI)  # nor for all-gathers
    # across 4 nodes of 8: the intra level by the curve, the inter level by its line
    across = group_span(32, 1, 8)
    assert all_reduce_s(1e6, across, c) == pytest.approx(1e-3 + 2 * 3 / 4 * (1e6 / 8) / BE + 2 * 2 * AE)
    assert p2p_s(5005e2, cross_node=True, cluster=c) == pytest.approx(5e-5 + 0.5 * 1.5e-4)
    assert p2p_s(1e6, cross_node=False, cluster=c) == pytest.approx(1e6 / BI + AI)


def test_the_finite_check_reads_the_local_gradients_and_reduces_two_numbers_over_the_world():
    """Before each optimizer step every rank reads its fp32 gradients once (twice under
    fp16: the unscale writes them) and 32 ranks all-reduce 8 bytes: a ring inside each
    node and a tree over the 4 nodes, each pass paying its latency."""
    from autopar.cost.data_parallel import finite_check_s
    from autopar.cost.model import CostModel
    from autopar.plan import ParallelConfig
    from autopar.vocab import Optimizer

    graph = extract(build_named_model("gpt3-6.7b"), seq_len=2048, attention="flash")
    model = CostModel(graph=graph, cluster=DGX, optimizer=Optimizer.ADAM, global_batch_size=32)
    bw = DGX.device.roofline.memory_bandwidth_bytes_per_s * DGX.device.roofline.memory_efficiency
    reduce_s = 2 * 7 / 8 * 8 / BI + 2 * 7 * AI + 2 * 3 / 4 * 1 / BE + 2 * 2 * AE
    for dtype, passes in ((DType.BF16, 1), (DType.FP16, 2)):
        config = ParallelConfig(dp=4, tp=8, pp=1, micro_batch_size=1, num_microbatches=1, dtype=dtype)
        expected = passes * 4 * 1e9 / bw + reduce_s
        assert finite_check_s(model, config, 1e9) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_inflight_is_monotone_in_the_rank(schedule):
    """The memory floor reads only the first and the last rank, so the least loaded rank
    must be one of them: in-flight micro-batches are monotone in the rank."""
    for pp in (2, 3, 4, 8):
        for v in (2, 3, 4) if schedule.multi_stage else (1,):
            if schedule is Schedule.ZBV and v != 2:
                continue
            for m in range(1, 3 * pp + 2):
                counts = [inflight_microbatches(schedule, pp, v, m, r) for r in range(pp)]
                assert counts == sorted(counts) or counts == sorted(counts, reverse=True), (pp, v, m, counts)
