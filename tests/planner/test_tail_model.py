"""The data-parallel tail under pipelining: each rank's idle time around its work
(:func:`autopar.cost.pipeline.rank_slack_s`) by hand, and the property it exists for: a
slower option never prices a faster step by hiding more of its rank's communication."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

import autopar
from autopar.cost.comm import all_gather_s, all_reduce_s, group_span, reduce_scatter_s
from autopar.cost.compute import rates
from autopar.cost.data_parallel import overlapped_s, tied_all_reduce_s
from autopar.cost.host import fsdp_copy_s
from autopar.cost.model import CostModel
from autopar.cost.peak import budget_bytes
from autopar.cost.pipeline import pipeline_time_s, rank_slack_s, stage_inflight_microbatches
from autopar.cost.stage import PricedStage
from autopar.cost.step import timing
from autopar.graph import extract
from autopar.hardware import preset
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig, build_named_model
from autopar.search.constraints import check_constraints
from autopar.search.scan import ALL_MODES
from autopar.search.solve import ConfigSolver
from autopar.search.space import enumerate_space
from autopar.vocab import DType, Optimizer, Schedule

from .exact_reference import tiny_cluster


def test_one_f_one_b_ranks_idle_for_the_ranks_before_them():
    """1F1B over 3 ranks of work 3, 5 and 4 per micro-batch (forwards 1, 2, 1): rank r waits
    for the forwards of the ranks before it and, after its last backward, for their
    backwards (2 and 3)."""
    work, forward, wgrad = [3.0, 5.0, 4.0], [1.0, 2.0, 1.0], [0.0, 0.0, 0.0]
    step = pipeline_time_s(work, 4, 1)
    assert step == 4 * 5 + (12 - 5)
    slack = rank_slack_s(work, forward, wgrad, 4, 1, schedule=Schedule.ONE_F_ONE_B, step_s=step)
    assert [s.lead_s for s in slack] == [0.0, 1.0, 3.0]
    assert [s.trail_s for s in slack] == [0.0, 2.0, 5.0]
    assert all(s.own_share == 1.0 for s in slack)


def test_interleaved_ranks_idle_for_one_chunk_of_the_ranks_before_them():
    """The same ranks in two chunks each: a chunk's forward and backward are half the
    rank's, and so is the share of a rank's own work its collectives overlap."""
    work, forward = [3.0, 5.0, 4.0], [1.0, 2.0, 1.0]
    slack = rank_slack_s(work, forward, [0.0] * 3, 6, 2, schedule=Schedule.INTERLEAVED_1F1B, step_s=40.0)
    assert [s.lead_s for s in slack] == [0.0, 0.5, 1.5]
    assert [s.trail_s for s in slack] == [0.0, 1.0, 2.5]
    assert all(s.own_share == 0.5 for s in slack)


def test_zero_bubble_ranks_idle_what_their_own_timeline_leaves():
    """Interleaved ZB over 2 ranks x 2 chunks, 4 micro-batches: rank 0 (F 2, I 3, W 1) runs
    ``4 * 6 + max(2 + 3 - 1, 2, 3) / 2 = 26``, rank 1 (F 1, I 2, W 1) ``4 * 4 + 2 / 2 = 17``:
    rank 1 idles the 9 between them."""
    work, forward, wgrad = [6.0, 4.0], [2.0, 1.0], [1.0, 1.0]
    step = pipeline_time_s(
        work, 4, 2, schedule=Schedule.INTERLEAVED_ZB, rank_forward_s=forward, rank_weight_grad_s=wgrad
    )
    assert step == 26.0
    slack = rank_slack_s(work, forward, wgrad, 4, 2, schedule=Schedule.INTERLEAVED_ZB, step_s=step)
    assert [(s.lead_s, s.trail_s) for s in slack] == [(0.0, 0.0), (9.0, 9.0)]


def _stages(config, bounds, options):
    """The stages of ``config`` split at ``bounds``, unit ``u`` running ``options[u]``."""
    return [
        PricedStage(
            index=c,
            units=tuple(range(bounds[c], bounds[c + 1])),
            options=tuple(options[bounds[c] : bounds[c + 1]]),
            inflight=stage_inflight_microbatches(
                config.schedule, config.pp, config.virtual_stages, config.num_microbatches, c
            ),
        )
        for c in range(len(bounds) - 1)
    ]


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_a_slower_option_never_prices_a_faster_step(zero_stage):
    """Every pipeline schedule at dp=2 x pp=2 x tp=2 on a 4-block Llama, every split, every
    unit: running one unit with an option no faster in its forward and its backward than
    the fastest, holding no fewer parameters (recomputation, another tensor-parallel
    layout), never lowers the step.
    Before each rank's idle time was counted, the tail's overlap grew with a rank's whole
    backward while the step, set by another rank, grew by a chunk of it: interleaved 1F1B
    at ZeRO-0, split E+1 | 1 | 1 | 1+L, priced 0.47418 ms with the first block recomputed
    against 0.47449 ms without."""
    cfg = LlamaConfig(vocab_size=512, seq_len=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384)
    graph = extract(Llama(cfg), seq_len=256, dtype="bf16")
    cluster = dataclasses.replace(tiny_cluster(1.0), nodes=2)
    model = CostModel(graph=graph, cluster=cluster, optimizer=Optimizer.ADAM, global_batch_size=8)
    solver = ConfigSolver(model=model, budget_bytes=budget_bytes(cluster.device.memory), micro_batches=(1, 2))
    fixed = check_constraints({"dp": 2, "pp": 2, "tp": 2, "zero_stage": zero_stage})
    configs, _ = enumerate_space(graph, cluster, 8, fixed)
    n = len(graph.units)
    schedules, checked = set(), 0
    for config in configs:
        options = {u: solver.options(u, config, ALL_MODES) for u in range(n)}
        fast = [min(options[u], key=lambda o: o.fwd_s + o.bwd_s) for u in range(n)]
        if config.virtual_stages > 1:
            splits = [solver.even_split(config.pp * config.virtual_stages, exact=True)]
        else:
            splits = [(0, *cuts, n) for cuts in itertools.combinations(range(1, n), config.pp - 1)]
        for bounds in splits:
            base = timing(model, config, _stages(config, bounds, fast)).step_s
            for u in range(n):
                for o in options[u]:
                    if o is fast[u] or min(o.fwd_s - fast[u].fwd_s, o.bwd_s - fast[u].bwd_s) < 0:
                        continue
                    if o.layout.param_numel < fast[u].layout.param_numel:  # fewer gradients to reduce
                        continue
                    chosen = [*fast[:u], o, *fast[u + 1 :]]
                    assert timing(model, config, _stages(config, bounds, chosen)).step_s >= base * (1 - 1e-12), (
                        config.short(),
                        bounds,
                        u,
                    )
                    checked += 1
        schedules.add(config.schedule)
    zero_bubble = {s for s in Schedule if s.zero_bubble}
    assert schedules == (
        set(Schedule) - zero_bubble if zero_stage == 3 else set(Schedule)
    )  # the runtime refuses ZeRO-3 there
    assert checked > 100


def test_a_hidden_collective_costs_the_slowdown_of_the_compute_beside_it():
    """A collective of ``c`` beside ``W`` of compute that can hide it, with the compute
    keeping 0.8 of its rate while it runs: ``0.2 c`` when it fits in the window, the rest in
    full when it does not, and the whole of it where nothing overlaps."""
    assert overlapped_s(2.0, 10.0, 0.2) == pytest.approx(0.4)  # hidden: slows 2 s of compute by a fifth
    assert overlapped_s(10.0, 4.0, 0.2) == pytest.approx(6.0 + 0.8)  # 6 s beyond it, 4 s slowed
    assert overlapped_s(3.0, 5.0, 0.0) == 0.0  # compute unslowed: free
    assert overlapped_s(3.0, 5.0, 1.0) == 3.0  # compute stops: all of it


def test_ddp_reduction_hidden_by_the_backward_still_slows_it():
    """DDP over the 8 GPUs of one DGX H100 node, GPT-2 small at 8 x 1024 tokens per GPU: the
    all-reduce of its fp32 gradients (a few ms over NVLink) is shorter than the backward, so
    it costs ``1 - comm_overlap`` of its time, but for its last bucket: the first unit's
    gradients (the token and position embeddings, a third of the model, the output layer's
    tied weight among them) are ready when the backward ends, and their all-reduce has
    nothing left to hide behind. Before, anything under ``comm_overlap`` of the backward was
    priced free (0 s). Nothing overlapping costs the whole all-reduce."""
    import autopar

    model = build_named_model("gpt2-small")
    cluster = preset("dgx-h100", nodes=1)
    cfg = {"dp": 8, "tp": 1, "pp": 1, "micro_batch_size": 8, "zero_stage": 0, "recompute": "none"}
    numel = sum(p.numel() for p in model.parameters())
    embeddings = model.tok_embeddings.weight.numel() + model.pos_embeddings.weight.numel()
    reduce_s, last_s = (all_reduce_s(4.0 * n, group_span(8, 1, 8), cluster) for n in (numel, embeddings))

    def tail(overlap):
        device = dataclasses.replace(cluster.device, comm_overlap=overlap)
        est = autopar.estimate(
            model, dataclasses.replace(cluster, device=device), cfg, global_batch_size=64, seq_len=1024
        )
        stage = est.prediction.stages[0]
        assert stage.units[:2] == ("tok_embeddings", "pos_embeddings")  # the first unit: reduced last
        assert stage.backward_s > reduce_s  # the backward could hide it all
        return est.prediction.breakdown.dp_comm_s

    assert cluster.device.comm_overlap == 0.8 and cluster.device.host.sync_speed_spread == 0.0
    assert 0.3 < embeddings / numel < 0.35
    assert tail(0.8) == pytest.approx(0.2 * (reduce_s - last_s) + last_s, rel=1e-6)
    assert tail(1.0) == pytest.approx(last_s, rel=1e-6)
    assert tail(0.0) == pytest.approx(reduce_s, rel=1e-6)


def test_fsdp_exposes_the_first_units_gather_and_reduce_scatter():
    """FSDP2 without resharding (ZeRO-2) over one DGX H100 node, GPT-2 small, one
    micro-batch, every collective otherwise hidden (``comm_overlap`` 1, no framework time):
    what is left is the first unit's all-gather, which its forward waits for with nothing
    before it, and its reduce-scatter, issued when the backward ends, each with FSDP2's
    copies: the token and position embeddings, a third of the model. Before, a stage paid
    an average unit's share of each."""
    import autopar

    model = build_named_model("gpt2-small")
    cluster = preset("dgx-h100", nodes=1)
    host = dataclasses.replace(cluster.device.host, fsdp_overhead_s=0.0, fsdp_tensor_overhead_s=0.0)
    device = dataclasses.replace(cluster.device, comm_overlap=1.0, host=host)
    cluster = dataclasses.replace(cluster, device=device)
    cfg = {"dp": 8, "tp": 1, "pp": 1, "micro_batch_size": 8, "zero_stage": 2, "recompute": "none", "compile": False}
    est = autopar.estimate(model, cluster, cfg, global_batch_size=64, seq_len=1024)
    embeddings = model.tok_embeddings.weight.numel() + model.pos_embeddings.weight.numel()
    span = group_span(8, 1, 8)
    streaming = rates(device, DType.BF16).bytes_per_s
    gather = all_gather_s(2.0 * embeddings, span, cluster) + fsdp_copy_s(
        host, 2.0 * embeddings, 8, streaming_bytes_per_s=streaming
    )
    reduce = reduce_scatter_s(4.0 * embeddings, span, cluster) + fsdp_copy_s(
        host, 4.0 * embeddings, 8, streaming_bytes_per_s=streaming
    )
    assert est.config.dtype is DType.BF16
    assert est.prediction.breakdown.dp_comm_s == pytest.approx(gather + reduce, rel=1e-6)


def test_the_tied_weights_all_reduce_is_pipeline_communication():
    """A tied GPT over tp=2 x pp=2 without data parallelism: the all-reduce of the tied
    embedding's gradient between the first and last stages was shown as "DP comm" of a
    plan with dp=1. The step's DP term is now 0, its PP term holds the all-reduce (the
    pair of ranks two stages apart, 4 bytes a shared parameter over tp) beside the
    point-to-point transfers of the critical rank, and the terms still add up to the step."""
    model = GPT(GPTConfig(vocab_size=512, seq_len=64, dim=128, n_layers=4, n_heads=4, tie_embeddings=True))
    cluster = tiny_cluster(64.0)
    plan = autopar.estimate(model, cluster, {"tp": 2, "pp": 2}, global_batch_size=8, seq_len=64)
    b, config = plan.prediction.breakdown, plan.config
    assert config.dp == 1 and b.dp_comm_s == 0.0
    cost = CostModel(
        graph=extract(model, seq_len=64), cluster=cluster, optimizer=autopar.Optimizer.ADAM, global_batch_size=8
    )
    tied = tied_all_reduce_s(cost, config)
    assert tied > 0
    m = config.num_microbatches
    assert any(b.pp_comm_s == pytest.approx(m * s.pp_comm_s + tied, rel=1e-9) for s in plan.prediction.stages)
    assert b.total_s == pytest.approx(plan.prediction.step_time_s, rel=1e-12)
