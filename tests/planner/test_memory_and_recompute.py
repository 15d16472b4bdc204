"""Memory and recomputation terms of the cost model against hand counts: model states by
ZeRO stage, what the head holds for the loss, what full recomputation reruns, and where
a rank that runs every forward first peaks."""

import math

import pytest

from autopar.cost.comm import all_reduce_s, group_span
from autopar.cost.compute import rates
from autopar.cost.leaf import TPContext
from autopar.cost.memory import state_bytes
from autopar.cost.tensor_parallel import evaluate_layout
from autopar.graph import extract
from autopar.hardware import preset
from autopar.vocab import DType, Layout, Optimizer, TPStyle


@pytest.mark.parametrize(
    "zero, dp, expected",
    [
        (0, 8, 4 + 2 + 4 + 8),  # ZeRO paper's mixed-precision Adam, with fp32 gradients: 18 B/param
        (1, 8, 4 + 2 + 4 + 8 / 8),
        (2, 8, 4 / 8 + 2 + 4 / 8 + 8 / 8),
        (3, 8, (4 + 4 + 8) / 8),
    ],
)
def test_model_state_bytes_per_parameter(zero, dp, expected):
    st = state_bytes(
        param_numel=1.0,
        factored_numel=0.0,
        largest_unit_numel=0.0,
        dtype=DType.BF16,
        optimizer=Optimizer.ADAM,
        zero_stage=zero,
        dp=dp,
        pipelined=False,
    )
    assert st.params_bytes + st.grads_bytes + st.optimizer_bytes == pytest.approx(expected)


def test_model_states_other_cases():
    fp32 = state_bytes(
        param_numel=1.0,
        factored_numel=0.0,
        largest_unit_numel=0.0,
        dtype=DType.FP32,
        optimizer=Optimizer.SGD,
        zero_stage=0,
        dp=1,
        pipelined=False,
    )
    assert fp32.params_bytes + fp32.grads_bytes + fp32.optimizer_bytes == 12  # weight, grad, momentum
    piped = state_bytes(
        param_numel=1.0,
        factored_numel=0.0,
        largest_unit_numel=0.0,
        dtype=DType.BF16,
        optimizer=Optimizer.ADAM,
        zero_stage=3,
        dp=4,
        pipelined=True,
    )
    # pipelining keeps FSDP2's unsharded compute copy and accumulates unsharded fp32 grads;
    # the sharded ones are reduce-scattered from them in the last backward, which frees them
    assert piped.params_bytes + piped.grads_bytes + piped.optimizer_bytes == pytest.approx(4 / 4 + 2 + 4 + 8 / 4)
    z3 = state_bytes(
        param_numel=100.0,
        factored_numel=0.0,
        largest_unit_numel=10.0,
        dtype=DType.BF16,
        optimizer=Optimizer.ADAM,
        zero_stage=3,
        dp=4,
        pipelined=False,
    )
    # two gathered units, and a unit's bf16 gradients beside FSDP2's fp32 reduce-scatter
    # input (or the previous unit's input, which it keeps)
    assert z3.transient_bytes == pytest.approx(2 * 10 * 2 + 10 * 2 + 10 * 4)
    ada = state_bytes(
        param_numel=1000.0,
        factored_numel=60.0,
        largest_unit_numel=0.0,
        dtype=DType.FP32,
        optimizer=Optimizer.ADAFACTOR,
        zero_stage=0,
        dp=1,
        pipelined=False,
    )
    assert ada.optimizer_bytes == 240.0


@pytest.mark.parametrize(
    "dtype, dp, pipelined, tp, params",
    [
        (DType.FP32, 2, True, 1, 4 + 4),  # FSDP2 replicate (pipelined): a gathered fp32 copy beside the weights
        (DType.FP32, 2, False, 2, 4 + 4),  # replicate for DTensor (tensor-parallel) parameters too
        (DType.FP32, 2, False, 1, 4),  # DDP: the weights only
        (DType.FP32, 1, True, 2, 4),  # no data parallelism, no wrapper
        (DType.BF16, 2, True, 1, 4 + 2),  # replicate gathers the bf16 compute copy, which autocast would make anyway
    ],
)
def test_zero0_parameters_under_replicate(dtype, dp, pipelined, tp, params):
    st = state_bytes(
        param_numel=1.0,
        factored_numel=0.0,
        largest_unit_numel=0.0,
        dtype=dtype,
        optimizer=Optimizer.SGD,
        zero_stage=0,
        dp=dp,
        pipelined=pipelined,
        tp=tp,
    )
    assert st.params_bytes == pytest.approx(params)


def _gpt_head(dtype: DType, tp: int):
    """A one-block GPT's config, its head unit and the head's context: the last unit, on
    ``tp`` of 2 local devices, 4 samples a micro-batch."""
    from autopar.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=2048, seq_len=64, dim=128, n_layers=1, n_heads=4)
    graph = extract(GPT(cfg), seq_len=cfg.seq_len, dtype=dtype)
    c = preset("local-cpu", devices_per_node=2)
    ctx = TPContext(
        tp=tp,
        span=group_span(tp, 1, 2),
        cluster=c,
        rates=rates(c.device, dtype),
        micro_batch=4,
        tokens=cfg.seq_len,
        boundary=Layout.R,
        first=False,
        last=True,
        loss_parallel=True,
        sequence_parallel=False,
        dtype=dtype,
    )
    return cfg, graph.profile_of(len(graph.units) - 1), ctx


def test_the_head_holds_its_logits_and_a_row_parallel_one_three_times():
    """The pipeline schedule holds the model's output until that micro-batch's backward
    (the loss saves its log-probabilities, not the logits): b s V 4 bytes more than the
    same unit holds where it is not the last, a vocabulary-sharded (column) head its
    shard, and a head whose output is all-reduced before the loss (row-parallel)
    DTensor's two extra copies too."""

    cfg, head, ctx = _gpt_head(DType.FP32, tp=2)
    b = ctx.micro_batch
    inner = TPContext(**{**ctx.__dict__, "last": False})
    logits = b * cfg.seq_len * cfg.vocab_size * 4
    for style, output, extra in (
        (TPStyle.ROW, Layout.R, 3 * logits),
        (TPStyle.COLUMN, Layout.F, logits / 2),
        (TPStyle.REPLICATE, Layout.R, logits),
    ):
        styles = tuple(style if leaf.name == "output" else TPStyle.REPLICATE for leaf in head.leaves)
        cost = evaluate_layout(head, styles, output, ctx)
        assert cost.saved_bytes - evaluate_layout(head, styles, output, inner).saved_bytes == pytest.approx(extra), (
            style
        )
        # the loss's backward holds one more gradient of the fp32 logits as the head lays
        # them out (partial sums are whole) than the one it returns, a vocabulary-parallel
        # one another shard (two shards: the logits' size again), all freed before the
        # head's own backward
        assert cost.loss_working_bytes == pytest.approx(logits), style
        assert cost.working_bytes - evaluate_layout(head, styles, output, inner).working_bytes == pytest.approx(
            logits / 2 if output is Layout.F else 0.0
        ), style
        assert evaluate_layout(head, styles, output, inner).loss_working_bytes == 0.0


@pytest.mark.parametrize("tp, output", [(1, Layout.R), (2, Layout.F)], ids=["replicated", "vocabulary-parallel"])
def test_the_loss_backward_holds_fp32_gradients_of_bf16_logits(tp, output):
    """The cross-entropy upcasts bf16 logits to fp32: at its backward's peak it holds the
    gradient of its log-probabilities and that of its input, both fp32 (twice the bf16
    logits each), a vocabulary-parallel one a third, in shards; beyond the bf16 gradient
    it returns (the head's output gradient, in its working memory anyway), that is
    3 bf16 logits replicated and 5 shards vocabulary-parallel."""

    cfg, head, ctx = _gpt_head(DType.BF16, tp=tp)
    b = ctx.micro_batch
    styles = tuple(TPStyle.COLUMN if leaf.name == "output" and tp > 1 else TPStyle.REPLICATE for leaf in head.leaves)
    shard = b * cfg.seq_len * cfg.vocab_size * 2 / tp
    cost = evaluate_layout(head, styles, output, ctx)
    assert cost.loss_working_bytes == pytest.approx((3 if tp == 1 else 5) * shard)


def test_full_recomputation_reruns_the_forward_but_the_loss_at_the_measured_fraction():
    """The last unit's glue into its output is the loss, which runs outside the modules
    the runtime checkpoints, as do a vocabulary-parallel loss's three reductions: full
    recomputation reruns the rest of the forward, its compute at the unit's measured
    fraction and its collectives whole."""
    import dataclasses

    from autopar.cost.recompute import make_option
    from autopar.graph import UNIT_OUTPUT
    from autopar.models import GPT, GPTConfig
    from autopar.vocab import Recompute

    cfg = GPTConfig(vocab_size=2048, seq_len=64, dim=128, n_layers=1, n_heads=4)
    graph = extract(GPT(cfg), seq_len=cfg.seq_len, dtype=DType.FP32)
    head = graph.profile_of(len(graph.units) - 1)
    c = preset("local-cpu", devices_per_node=2)
    ctx = TPContext(
        tp=2,
        span=group_span(2, 1, 2),
        cluster=c,
        rates=rates(c.device, DType.FP32),
        micro_batch=4,
        tokens=cfg.seq_len,
        boundary=Layout.R,
        first=False,
        last=True,
        loss_parallel=True,
        sequence_parallel=False,
    )
    no_loss = dataclasses.replace(
        head,
        flows=tuple(
            dataclasses.replace(f, glue_flops=0.0, glue_bytes=0.0, glue_ops=0.0) if f.dst == UNIT_OUTPUT else f
            for f in head.flows
        ),
    )
    for style, output, reductions in ((TPStyle.COLUMN, Layout.F, 3), (TPStyle.REPLICATE, Layout.R, 0)):
        styles = tuple(style if leaf.name == "output" else TPStyle.REPLICATE for leaf in head.leaves)
        cost = evaluate_layout(head, styles, output, ctx)
        assert cost.loss_fwd_compute_s > 0
        assert cost.fwd_compute_s - cost.loss_fwd_compute_s == pytest.approx(
            evaluate_layout(no_loss, styles, output, ctx).fwd_compute_s, rel=1e-12
        )
        assert cost.loss_fwd_syncs == reductions
        assert cost.loss_fwd_comm_s == (
            pytest.approx(3 * all_reduce_s(4 * cfg.seq_len * 4, ctx.span, c)) if reductions else 0.0
        )
    block = evaluate_layout(
        graph.profile_of(1),
        (TPStyle.REPLICATE,) * len(graph.profile_of(1).leaves),
        Layout.R,
        TPContext(**{**ctx.__dict__, "last": False}),
    )
    assert (block.loss_fwd_compute_s, block.loss_fwd_comm_s, block.loss_fwd_syncs) == (0.0, 0.0, 0)
    lay = dataclasses.replace(
        block,
        fwd_compute_s=10.0,
        loss_fwd_compute_s=2.0,
        fwd_comm_s=3.0,
        loss_fwd_comm_s=1.0,
        bwd_compute_s=20.0,
        bwd_comm_s=4.0,
        fwd_syncs=5,
        loss_fwd_syncs=3,
        bwd_syncs=2,
        saved_bytes=block.saved_bytes + 1000.0,
        loss_saved_bytes=1000.0,
    )
    full = make_option(lay, Recompute.FULL, 100.0, 7.0, 0.5)
    assert full.recompute_s == 0.5 * (10 - 2) + (3 - 1)
    # the loss's logits and log-probabilities outlive the checkpoint: activations still
    assert full.act_bytes == lay.input_bytes + 1000.0
    assert full.transient_bytes == block.saved_bytes + lay.attn_saved_bytes + lay.working_bytes
    assert (full.fwd_s, full.bwd_s) == (13.0, 20 + 4 + 6)
    assert (full.tp_comm_s, full.syncs, full.recompute_flops) == (3 + 4 + 2, 5 + 2 + 2, 100.0)
    kept = make_option(lay, Recompute.NONE, 100.0, 7.0, 0.5)
    assert (kept.recompute_s, kept.bwd_s, kept.tp_comm_s, kept.syncs) == (0.0, 24.0, 7.0, 7)


def test_the_backward_peak_by_hand():
    """Units in forward order with activations (4, 2, 6), transients (1, 5, 2) and
    gradients of 3 each.

    Fresh gradients (every forward before the first backward, none left by zero_grad),
    one micro-batch: at the middle unit's backward the first two units' activations (6),
    the last unit's gradients (3) and its transient (5) are alive, 14, tied with the
    last unit's (12 + 0 + 2) and found first. Two in flight: the other micro-batch adds
    all its activations (12) to each moment, 26; after the first micro-batch's backward
    every gradient exists but one micro-batch's activations are gone, at most
    12 + 9 + 2 = 23.

    Gradients there all along (a later micro-batch, or DDP's buckets): the last unit's
    backward holds every activation, every gradient and its transient, 12 + 9 + 2 = 23,
    over the middle unit's 6 + 9 + 5 = 20, where the bound (all activations with the
    largest transient) says 26; with two in flight, 24 + 9 + 2 = 35."""
    from autopar.cost.peak_walks import backward_peak as _backward_peak

    acts, transients, grads = [4.0, 2.0, 6.0], [1.0, 5.0, 2.0], [3.0, 3.0, 3.0]
    assert _backward_peak(acts, transients, grads, 1, fresh_gradients=True) == (6.0, 3.0, 5.0, 0.0)
    assert _backward_peak(acts, transients, grads, 2, fresh_gradients=True) == (18.0, 3.0, 5.0, 0.0)
    assert _backward_peak([0.0], [0.0], [9.0], 1, fresh_gradients=True) == (0.0, 9.0, 0.0, 0.0)  # only the gradients
    assert _backward_peak(acts, transients, grads, 1, fresh_gradients=False) == (12.0, 9.0, 2.0, 0.0)
    assert _backward_peak(acts, transients, grads, 2, fresh_gradients=False) == (24.0, 9.0, 2.0, 0.0)
    assert _backward_peak(acts, [1.0, 9.0, 2.0], grads, 1, fresh_gradients=False) == (6.0, 9.0, 9.0, 0.0)
    # the last unit's logits (4 of its 6) stay until the backward is over: the middle
    # unit's moment holds them too, 10 + 9 + 5 = 24, over the last unit's 12 + 9 + 2
    assert _backward_peak(acts, transients, grads, 1, fresh_gradients=False, held_to_end=4.0) == (10.0, 9.0, 5.0, 0.0)
    # parameter copies of (1, 1, 4) freed as each unit's backward in the last micro-batch
    # ends: one micro-batch, the middle unit's moment has lost the last unit's 4 (6 + 3 +
    # 5 - 4 = 10), the first unit's 5 (4 + 6 + 1 - 5 = 6), so the last unit's 12 + 0 + 2
    # is the peak; after the backward 9 - 6 = 3. Accumulating, an earlier micro-batch
    # holds every copy: the peak is as without them.
    freed = [1.0, 1.0, 4.0]
    assert _backward_peak(acts, transients, grads, 1, fresh_gradients=True, freed=freed) == (12.0, 0.0, 2.0, 0.0)
    assert _backward_peak(acts, transients, grads, 1, fresh_gradients=False, freed=freed) == (12.0, 9.0, 2.0, 0.0)
    # only the gradients, less every copy: 9 - 2 over the unit's moment, 0
    assert _backward_peak([0.0], [0.0], [9.0], 1, fresh_gradients=True, freed=[2.0]) == (0.0, 9.0, 0.0, 2.0)
    # accumulating, activations (4, 2, 1), transients (1, 9, 2) in the last micro-batch
    # and 1 each before it: the middle unit's moment in the last micro-batch, 6 + 9 + 9 - 4
    # = 20, over an earlier micro-batch's 6 + 9 + 1 and the last unit's 7 + 9 + 2; priced
    # with the last micro-batch's transients in every micro-batch, 6 + 9 + 9 = 24
    small, spiky = [4.0, 2.0, 1.0], [1.0, 9.0, 2.0]
    assert _backward_peak(small, spiky, grads, 1, fresh_gradients=False, freed=freed) == (6.0, 9.0, 9.0, 0.0)
    peak = _backward_peak(small, spiky, grads, 1, fresh_gradients=False, freed=freed, before_last=[1.0] * 3)
    assert peak == (6.0, 9.0, 9.0, 4.0)
    # units that reduce once their backward is over (ZeRO-2), transients (1, 2, 1) while
    # their backward runs: the middle unit's reduction (9) meets neither its activations
    # (2) nor its copy (1), 4 + 3 + 9 - 5 = 11, over its running backward's 6 + 3 + 2 - 4
    # = 7 and the last unit's start, 7 + 0 + 1; priced beside both, 6 + 3 + 9 - 4 = 14
    running = [1.0, 2.0, 1.0]
    assert _backward_peak(small, spiky, grads, 1, fresh_gradients=True, freed=freed, running=running) == (
        4.0,
        3.0,
        9.0,
        5.0,
    )
    assert _backward_peak(small, spiky, grads, 1, fresh_gradients=True, freed=freed) == (6.0, 3.0, 9.0, 4.0)
    # accumulating: an earlier micro-batch's reduction of the middle unit, every copy
    # held, 4 + 9 + 9 = 22 (24 with its activations)
    peak = _backward_peak(small, spiky, grads, 1, fresh_gradients=False, freed=freed, running=running)
    assert peak == (4.0, 9.0, 9.0, 0.0)
    # a unit without a running transient (tied to another, reduced with the root) keeps
    # its activations beside its transient: the middle unit's 6 + 3 + 9 - 4 again
    assert _backward_peak(small, spiky, grads, 1, fresh_gradients=True, freed=freed, running=[1.0, None, 1.0]) == (
        6.0,
        3.0,
        9.0,
        4.0,
    )


def test_the_first_forward_peak_by_hand():
    """ZeRO-2 gathers each unit's copy (1, 1, 4) as the step's first forward reaches it
    and keeps it; FSDP2 keeps each flat all-gather buffer until the next all-gather. At
    the last unit's gather: the activations of the two before it (4 + 2), its buffer (4)
    beside the middle unit's (1), every copy gathered: 6 + 0 + 5 - 0 = 11, over the
    middle unit's 4 + 2 - 4 = 2 (the last copy still to come)."""
    from autopar.cost.peak_walks import first_forward_peak

    assert first_forward_peak([4.0, 2.0, 6.0], [1.0, 1.0, 4.0]) == (6.0, 0.0, 5.0, 0.0)
    # a large first unit (9): its buffer is still held at the middle unit's gather, 4 +
    # (9 + 1) - 1 = 13, over its own gather's 0 + 9 - 2 = 7 and the last unit's 4 + 2
    assert first_forward_peak([4.0, 0.0, 0.0], [9.0, 1.0, 1.0]) == (4.0, 0.0, 10.0, 1.0)


def test_a_tied_weight_is_held_once_only_where_both_owners_split_it_alike():
    """GPT's embedding and head share one (vocabulary x dim) weight, and both owners'
    options count its state. One rank keeps it as one tensor where both replicate it or
    both split its rows (an embedding 'vocab' and a head 'column'): the planner then
    counts it once, whole or one shard. A replicated embedding beside a column-parallel
    head are two tensors on the rank (``autopar.runtime.tied``), both held."""
    import dataclasses

    from autopar.cost.model import CostModel
    from autopar.cost.peak import held_once_numel, shared_state_bytes
    from autopar.models import GPT, GPTConfig
    from autopar.plan import ParallelConfig
    from autopar.search.solve import ConfigSolver
    from autopar.vocab import Recompute

    cfg = GPTConfig(vocab_size=2048, seq_len=64, dim=128, n_layers=1, n_heads=4)
    graph = extract(GPT(cfg), seq_len=cfg.seq_len, dtype=DType.FP32)
    (tied,) = graph.shared
    assert (tied.first_module, tied.second_module, tied.numel) == ("tok_embeddings", "output", 2048 * 128)
    model = CostModel(
        graph=graph, cluster=preset("local-cpu", devices_per_node=2), optimizer=Optimizer.ADAM, global_batch_size=4
    )
    ev = ConfigSolver(model=model, budget_bytes=math.inf)
    last = len(graph.units) - 1

    def styled(config, unit, module, style):
        option = ev.options(unit, config, (Recompute.NONE,))[0]
        styles = tuple(
            style if graph.units[unit].leaf_fqn(leaf.name) == module else TPStyle.REPLICATE
            for leaf in graph.profile_of(unit).leaves
        )
        return dataclasses.replace(option, layout=dataclasses.replace(option.layout, styles=styles))

    for tp, embedding, head, once in (
        (1, TPStyle.REPLICATE, TPStyle.REPLICATE, tied.numel),
        (2, TPStyle.REPLICATE, TPStyle.REPLICATE, tied.numel),
        (2, TPStyle.VOCAB, TPStyle.COLUMN, tied.numel / 2),
        (2, TPStyle.REPLICATE, TPStyle.COLUMN, 0.0),
        (2, TPStyle.VOCAB, TPStyle.REPLICATE, 0.0),
    ):
        config = ParallelConfig(dp=1, tp=tp, pp=1, micro_batch_size=4, num_microbatches=1, dtype=DType.FP32)
        both = {0: styled(config, 0, "tok_embeddings", embedding), last: styled(config, last, "output", head)}
        assert held_once_numel(model, config, both) == once, (tp, embedding, head)
        assert held_once_numel(model, config, {0: both[0]}) == 0.0  # the head on another pipeline rank
        # fp32 parameters, gradients and Adam's two moments: 16 bytes an element
        assert shared_state_bytes(model, config, once) == 16 * once


def _llama_block_ctx(tp: int, sp: bool):
    from autopar.models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=1000, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, seq_len=64)
    graph = extract(Llama(cfg), seq_len=cfg.seq_len)  # bf16: 128 bytes per feature of a 64-token sample
    c = preset("dgx-h100", devices_per_node=8)
    ctx = TPContext(
        tp=tp,
        span=group_span(tp, 1, 8),
        cluster=c,
        rates=rates(c.device, DType.BF16),
        micro_batch=2,
        tokens=cfg.seq_len,
        boundary=Layout.Q if sp else Layout.R,
        first=False,
        last=False,
        loss_parallel=True,
        sequence_parallel=sp,
    )
    return graph.profile_of(1), ctx


@pytest.mark.parametrize("tp, sp", [(1, False), (2, True)])
def test_per_operator_recomputation_keeps_every_other_matmul_the_attention_and_the_scatters(tp, sp):
    """A Llama block's seven bias-free matmuls run wq wk wv wo w1 w3 w2: ``op`` keeps the
    outputs of wq, wv, w1 and w2 (the first, third, fifth and seventh), the attention's
    output and, with sequence parallelism, the two reduce-scatters' shards; by hand in
    bytes per sample (64 tokens x 2 bytes = 128 per feature): q 256, v 128, w1 512, w2
    256 and the attention 256 features, column-split ones halved at tp=2, the
    row-parallel w2's partial sums whole. It reruns the rest of the forward: the
    forward less the kept matmuls and the attention core."""
    from autopar.cost.recompute import price_option
    from autopar.cost.saved_ops import kept_flops, kept_matmuls
    from autopar.vocab import Recompute

    block, ctx = _llama_block_ctx(tp, sp)
    names = [leaf.name for leaf in block.leaves]
    assert sorted(names[i] for i in kept_matmuls(block)) == sorted(
        ["attention.wq", "attention.wv", "feed_forward.w1", "feed_forward.w2"]
    )
    col, row = (TPStyle.COLUMN, TPStyle.ROW) if tp > 1 else (TPStyle.REPLICATE, TPStyle.REPLICATE)
    norm = TPStyle.SEQUENCE if sp else TPStyle.REPLICATE
    by_name = {
        "attention_norm": norm,
        "ffn_norm": norm,
        "attention.wo": row,
        "feed_forward.w2": row,
    }
    styles = tuple(by_name.get(n, col) for n in names)
    lay = evaluate_layout(block, styles, Layout.Q if sp else Layout.R, ctx)
    per_feature = 128 * ctx.micro_batch
    split = 2 if tp > 1 else 1
    kept = (256 / split + 128 / split + 512 / split + 256 + 256 / split) * per_feature
    scatters = 2 * 256 * per_feature / split if sp else 0.0
    assert lay.op_kept_bytes == pytest.approx(kept + scatters)
    none = price_option(block, lay, Recompute.NONE, ctx)
    op = price_option(block, lay, Recompute.OP, ctx)
    full = price_option(block, lay, Recompute.FULL, ctx)
    assert op.act_bytes == pytest.approx(lay.input_bytes + kept + scatters)
    assert full.act_bytes < op.act_bytes < none.act_bytes
    rerun = ctx.recompute_fraction * (lay.fwd_compute_s - lay.op_kept_compute_s) + lay.fwd_comm_s - lay.op_kept_comm_s
    assert op.recompute_s == pytest.approx(rerun)
    assert 0 < op.recompute_s < full.recompute_s
    kept_mm = sum(block.leaves[i].fwd_flops for i in kept_matmuls(block))
    assert kept_flops(block) == pytest.approx(kept_mm + sum(f.attn_flops for f in block.flows))
    assert op.recompute_flops == pytest.approx(full.recompute_flops - kept_flops(block))
    assert op.syncs == full.syncs - (2 if sp else 0)  # the reduce-scatters are not rerun
