"""Expert parallelism (``ep``): each MoE layer's experts split over ``ep`` consecutive
data-parallel ranks, rows exchanged by all-to-all, expert gradients averaged over the
ranks holding the same experts. Runs against one process: the same losses, gradient
norms and weights, on autopar's ``moe-tiny`` (8 experts, top-2, capacity buffers)."""

import functools

import pytest
import torch
from parity import (
    LOSS_ATOL,
    LR,
    MOE_CFG,
    assert_parity,
    build,
    make_plan,
    megatron_styles,
    reference,
    resumable,
    run,
    step_collectives,
    token_loss,
    train,
    with_cp,
    with_ep,
)

from autopar.runtime.api import parallelize
from autopar.runtime.recompute import clean_fqn

pytestmark = pytest.mark.multiprocess

NAME = "moe-tiny"
STEPS = 3
EXPERTS = 8


def _expert_numel() -> int:
    return sum(p.numel() for n, p in build(NAME).named_parameters() if n.endswith((".w1", ".w2", ".w3")))


def _total_numel() -> int:
    return sum(p.numel() for p in build(NAME).parameters())


@pytest.mark.parametrize("case", ["zero0", "zero3", "recompute"])
def test_expert_parallelism_trains_like_one_process_and_holds_half_of_the_experts(case):
    """dp=2 ep=2, SGD with momentum and clipping: the same losses, gradient norms (each
    expert's gradient counted once) and weights as one process; each rank keeps the
    momentum of its 4 of the 8 experts, and of the dense weights (ZeRO-0, and with every
    block recomputed: the exchange reruns in backward) or of half of them (ZeRO-3; the
    routers stay whole, wrapped with their experts on the one-rank ``ep_replicate`` mesh)."""
    config = {"zero3": dict(zero_stage=3), "recompute": dict(recompute={f"layers.{i}": "full" for i in range(4)})}
    plan = make_plan(NAME, dp=2, ep=2, **config.get(case, {}))
    results = run(train, 2, NAME, plan, STEPS, 0.5, None, None, 0.9)
    assert_parity(results, reference(NAME, plan, STEPS, clip=0.5, momentum=0.9))
    router = sum(p.numel() for n, p in build(NAME).named_parameters() if n.endswith(".router"))
    dense = _total_numel() - _expert_numel() - router
    expected = (dense // 2 if case == "zero3" else dense) + router + _expert_numel() // 2
    assert [r.extra["optimizer_state_numel"] for r in results] == [expected] * 2


@pytest.mark.parametrize("zero", [1, 3])
def test_experts_replicated_over_two_expert_groups_train_like_one_process(zero):
    """dp=4 ep=2 (expert_replicas 2): ranks {0, 2} hold experts 0-3 and {1, 3} experts
    4-7. ZeRO-1 shards only the dense state (every rank steps its own experts); ZeRO-3
    shards the experts again over their 2 replicas, so each rank keeps a quarter of
    every weight's momentum, except the routers': sharded with their experts' module
    over the 2 replicas, each rank keeps half of them."""
    plan = make_plan(NAME, dp=4, ep=2, zero_stage=zero)
    assert plan.config.expert_replicas == 2
    results = run(train, 4, NAME, plan, STEPS, 0.5, None, None, 0.9, timeout_s=120)
    assert_parity(results, reference(NAME, plan, STEPS, clip=0.5, momentum=0.9))
    if zero == 3:
        router = sum(p.numel() for n, p in build(NAME).named_parameters() if n.endswith(".router"))
        expected = (_total_numel() - router) // 4 + router // 2
        assert [r.extra["optimizer_state_numel"] for r in results] == [expected] * 4


def test_one_local_expert_is_sharded_over_its_replicas_along_its_width():
    """8 ranks, the 4-expert test MoE at ep=4 under ZeRO-3: each rank holds 1 expert,
    held by 2 replicas. FSDP2 would shard that stack along its experts (1 over 2 ranks:
    all on one, none on the other); sharded along its width, every rank keeps an eighth
    of every weight's momentum and the same losses as one process."""
    plan = make_plan("moe", dp=8, ep=4, zero_stage=3)
    assert (plan.config.expert_replicas, MOE_CFG.n_experts // plan.config.ep) == (2, 1)
    results = run(train, 8, "moe", plan, STEPS, 0.5, None, None, 0.9, timeout_s=180)
    assert_parity(results, reference("moe", plan, STEPS, clip=0.5, momentum=0.9))
    model = build("moe")
    router = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".router"))
    expected = (sum(p.numel() for p in model.parameters()) - router) // 8 + router // 2
    assert [r.extra["optimizer_state_numel"] for r in results] == [expected] * 8


def test_expert_parallelism_inside_tensor_parallelism_trains_like_one_process():
    """4 ranks: tp=2 (Megatron styles on the attention; the MoE layer replicated over the
    tp pair) inside dp=2 ep=2: each tp rank exchanges its rows with its own ep group."""
    plan = make_plan(NAME, dp=2, ep=2, tp=2, styles=megatron_styles(NAME))
    assert_parity(run(train, 4, NAME, plan, STEPS, 0.5, timeout_s=120), reference(NAME, plan, STEPS, clip=0.5))


def test_expert_parallelism_under_pipelining_trains_like_one_process():
    """4 ranks: pp=2 over dp=2 ep=2; each stage's MoE layers exchange rows per micro-batch."""
    plan = make_plan(NAME, dp=2, ep=2, pp=2)
    assert_parity(run(train, 4, NAME, plan, STEPS, 0.5, timeout_s=120), reference(NAME, plan, STEPS, clip=0.5))


def _all_to_all(func, args):
    """An all-to-all, by op namespace: the functional collectives' ``all_to_all_single``
    (``all_to_all_single_autograd`` dispatches it in forward and backward), the only
    all-to-all op expert parallelism uses."""
    return func.namespace if func._opname == "all_to_all_single" else None


EXPERT_WEIGHTS = {"moe-tiny": (".w1", ".w2", ".w3"), "mixtral": (".gate_up_proj", ".down_proj")}


def _shards_and_all_to_alls(rank, world, plan, name):
    if name == "mixtral":
        from test_models import hf_loss, mixtral

        job = parallelize(mixtral(), plan, loss_fn=hf_loss, measure_memory=False)
    else:
        job = parallelize(build(name), plan, loss_fn=token_loss, measure_memory=False)
    shapes = {
        clean_fqn(n): (tuple(p.to_local().shape), tuple(p.shape), p.device_mesh.mesh_dim_names)
        for stage in job.stages
        for n, p in stage.named_parameters()
        if n.endswith(EXPERT_WEIGHTS[name])
    }
    return shapes, step_collectives(job, plan, _all_to_all)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_each_rank_holds_its_experts_and_exchanges_rows_four_times_per_layer(recompute):
    """dp=2 ep=2 with m=2 micro-batches over 4 MoE layers: every expert weight is a
    ``(8, ...)`` DTensor of which a rank holds 4 rows, on the (ep_replicate, ep) mesh.
    Per layer and micro-batch the forward dispatches and combines (2 all-to-alls) and the
    backward runs their reverses (2 more): 4 x 4 x 2 = 32 per step, as the cost model
    prices it; full recomputation reruns the forward's two in the backward: 6 per layer."""
    m, layers = 2, 4
    plan = make_plan(NAME, dp=2, ep=2, num_microbatches=m, recompute={f"layers.{i}": recompute for i in range(layers)})
    per_layer = 6 if recompute == "full" else 4
    for shapes, counts in run(_shards_and_all_to_alls, 2, plan, NAME):
        assert len(shapes) == 3 * layers
        assert {(local[0], full_[0], mesh) for local, full_, mesh in shapes.values()} == {
            (EXPERTS // 2, EXPERTS, ("ep_replicate", "ep"))
        }
        assert counts == {"_c10d_functional": per_layer * layers * m}


def test_dropless_experts_also_exchange_their_token_counts():
    """The transformers Mixtral (4 experts, dropless) at dp=2 ep=2, m=2, 4 layers: each
    rank holds 2 of the 4 experts of every layer; per layer and micro-batch the ranks
    first exchange their token counts per expert (one all-to-all without gradient), then
    the rows go and come back as for capacity buffers (2 + 2): 5 x 4 x 2 = 40 per step."""
    from test_models import LAYERS, make, mixtral

    plan = with_ep(make(mixtral(), dp=2), 2)
    for shapes, counts in run(_shards_and_all_to_alls, 2, plan, "mixtral"):
        assert len(shapes) == 2 * LAYERS
        assert {(local[0], full_[0]) for local, full_, _ in shapes.values()} == {(2, 4)}
        assert counts == {"_c10d_functional": 5 * LAYERS * plan.config.num_microbatches}


def _refusal(model, plan, error=None):
    from autopar.runtime.api import analyse
    from autopar.runtime.errors import ExpertParallelError

    with pytest.raises(error or ExpertParallelError) as info:
        analyse(model, plan)
    return str(info.value)


def test_plans_the_runtime_cannot_run_are_refused_in_one_line():
    """Refused before any collective: an ep that does not divide the experts (ep=4 on
    the 4-expert test MoE, fine; ep=8 on dp=8: 4 experts do not split over 8), a model
    without experts, and context parallelism on capacity-bounded experts, with or
    without ep (their buffers fill in token order over the whole sequence)."""
    message = _refusal(build("moe"), with_ep(make_plan("moe", dp=8), 8))
    assert "ep=8 does not divide the 4 experts" in message and "\n" not in message
    message = _refusal(build("gpt"), with_ep(make_plan("gpt", dp=2), 2))
    assert "has no experts module" in message and "\n" not in message
    from autopar.runtime.errors import ContextParallelError

    for ep in (1, 2):
        message = _refusal(build(NAME), with_ep(with_cp(make_plan(NAME), 2), ep), ContextParallelError)
        assert "cp=2: capacity-bounded experts (MoEFeedForward)" in message and "\n" not in message


@pytest.mark.parametrize("case", ["dp2", "dp2-pp2", "dp2-tp2", "cp2"])
def test_transformers_mixtral_experts_exchange_their_tokens_like_one_process(case):
    """A tiny transformers Mixtral (4 experts, top-2, dropless) at dp=2 ep=2, alone, under
    pp=2, inside tp=2 (attention split, the MoE block replicated over the tp pair), and
    over cp=2 (ep taken from the context-parallel pair: each rank routes its half of
    every sequence; dropless routing is per token): each rank holds 2 experts, receives
    every token routed to them, runs them with the module's own forward and returns the
    outputs."""
    from test_models import LAYERS, hf_reference, hf_train, make, mixtral

    spec = {"dp2": dict(dp=2), "dp2-pp2": dict(dp=2, pp=2), "dp2-tp2": dict(dp=2, tp=2), "cp2": {}}[case]
    styles = None
    if case == "dp2-tp2":
        styles = {f"model.layers.{i}.self_attn.{p}_proj": "column" for i in range(LAYERS) for p in "qkv"}
        styles |= {f"model.layers.{i}.self_attn.o_proj": "row" for i in range(LAYERS)}
    plan = make(mixtral(), styles, **spec)
    plan = with_ep(with_cp(plan, 2) if case == "cp2" else plan, 2)
    ref = hf_reference("mixtral", plan, steps=STEPS)
    assert_parity(run(hf_train, plan.config.world_size, "mixtral", plan, STEPS, timeout_s=120), ref)


def test_transformers_gpt_oss_experts_exchange_their_tokens_like_one_process():
    """A tiny GPT-OSS at dp=2 ep=2: experts with biases, stacked transposed to Mixtral's,
    whose forward names its arguments (hidden_states, router_indices, routing_weights);
    each rank holds 2 of the 4 experts, biases included, and trains as one process."""
    from test_models import gpt_oss, hf_reference, hf_train, make

    plan = with_ep(make(gpt_oss(), dp=2), 2)
    ref = hf_reference("gpt-oss", plan, steps=STEPS)
    assert_parity(run(hf_train, plan.config.world_size, "gpt-oss", plan, STEPS, timeout_s=120), ref)


def _resumable(rank, world, plan, path, resume, steps, save_at):
    job = parallelize(build(NAME), plan, loss_fn=token_loss, measure_memory=False)
    opt = job.optimizer(torch.optim.SGD, lr=LR, momentum=0.9)
    losses, start = resumable(job, opt, NAME, path, resume, steps, save_at)
    return losses, start


@pytest.mark.parametrize("saver_ep,loader_ep", [(2, 1), (1, 2)])
def test_a_checkpoint_saved_under_one_expert_split_resumes_under_another(tmp_path, saver_ep, loader_ep):
    """Saved by dp=2 at one ep (ep=2: each rank writes its 4 experts of every layer and
    their momentum, under ZeRO-3), resumed at the other (ZeRO-1): the resumed run
    continues the uninterrupted single-process run."""
    steps, save_at = 4, 2
    saver = make_plan(NAME, dp=2, ep=saver_ep, zero_stage=3)
    loader = make_plan(NAME, dp=2, ep=loader_ep, zero_stage=1)
    ref = reference(NAME, saver, steps, momentum=0.9)
    first = run(_resumable, 2, saver, str(tmp_path), False, steps, save_at)
    second = run(_resumable, 2, loader, str(tmp_path), True, steps, None)
    for losses, _ in first:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses[:save_at]), rtol=0, atol=LOSS_ATOL)
    for losses, start in second:
        assert start == save_at
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses[save_at:]), rtol=0, atol=LOSS_ATOL)


def test_a_measured_dry_run_splits_the_experts():
    """On the fake process group: dp=4 ep=2 ZeRO-3 holds a quarter of every fp32 weight
    but half of the routers (as on 4 real ranks above)."""
    from autopar.runtime.dry_run import dry_run

    plan = with_ep(make_plan(NAME, dp=4, zero_stage=3), 2)
    report = dry_run(lambda: build(NAME, "meta"), plan, measure=True)
    assert not report.problems
    router = sum(p.numel() for n, p in build(NAME).named_parameters() if n.endswith(".router"))
    assert report.ranks[0].param_bytes == 4 * ((_total_numel() - router) // 4 + router // 2)
    assert report.assumed_routing is None  # capacity buffers: no routing assumed


def _meta_mixtral():
    from test_models import mixtral

    with torch.device("meta"):
        return mixtral()


def _balanced_routers(model, tokens):
    """Make every router of the tiny Mixtral pick a perfectly balanced pattern: token
    ``t``'s ``j``-th choice is expert ``(t * top_k + j) mod experts``, so each expert gets
    ``tokens * top_k / experts`` rows. The router still runs (its own allocations and
    gradient); its indices are overwritten in place through ``.data`` (top-k saved them
    for backward) from a pattern made before the step, so no byte is added."""
    for module in model.modules():
        if type(module).__name__ != "MixtralTopKRouter":
            continue
        k, experts = module.top_k, module.num_experts
        pattern = torch.arange(tokens * k).view(tokens, k) % experts

        def route(hidden_states, forward=module.forward, pattern=pattern):
            logits, scores, indices = forward(hidden_states)
            indices.data.copy_(pattern)
            return logits, scores, indices

        module.forward = route


def _balanced_peak(rank, world, plan):
    """The measured peak and held bytes of one real step of the tiny Mixtral, routed
    perfectly evenly (:func:`_balanced_routers`), with the dry run's loss."""
    from test_models import mixtral

    from autopar.runtime.dry_step import measure_step
    from autopar.runtime.local import cross_entropy

    model = mixtral()
    _balanced_routers(model, plan.config.micro_batch_size * plan.model.seq_len)
    job = parallelize(model, plan, loss_fn=cross_entropy, measure_memory=False)
    step = measure_step(job, plan, None)
    return step.peak_bytes, step.held_bytes


def test_a_measured_dry_run_runs_dropless_experts_at_balanced_routing():
    """A transformers Mixtral's dropless exchange needs real routing, which fake tensors
    lack: the measured dry run assumes the balanced routing the plan prices (each of the
    4 experts gets tokens x top_k / 4 rows) and says so. dp=2 ep=2 ZeRO-3 (bf16: torch's
    fake grouped matmul takes bf16 only, as on CUDA), against the same count on a real
    2-process gloo step whose routers are forced to that balanced pattern: the same
    split sizes, rows and local experts' forward. Measured: 691,944 bytes at the peak on
    both, byte for byte, held bytes equal (the real step measured 8 KiB more on one rank
    once in four runs). Before the dry run's transformers models called SDPA causal as
    real ones do, they built a causal mask on fake tensors: 698,088 (+0.9%). Peaks within
    2% (the dense models' fake-real gap reaches 3.3%, test_dry_step), which still catches
    a wrong routing: the same step at an imbalance of 1.5 measures +4.7%; held bytes
    within 1%."""
    from test_models import make, mixtral

    from autopar.runtime.dry_run import dry_run

    plan = with_ep(make(mixtral(), dp=2, zero_stage=3, dtype="bf16"), 2)
    real = run(_balanced_peak, 2, plan, timeout_s=120)
    report = dry_run(_meta_mixtral, plan, ranks=[0, 1], measure=True)
    assert report.ok, report.problems
    assert report.assumed_routing == 1.0
    assert "dropless experts measured at balanced routing" in report.to_text()
    for r in report.ranks:
        peak, held = real[r.rank]
        assert r.measured.peak_bytes == pytest.approx(peak, rel=0.02), (r.rank, r.measured, peak)
        assert r.measured.held_bytes == pytest.approx(held, rel=0.01), (r.rank, r.measured, held)


@pytest.mark.parametrize("ep", [1, 2])
def test_a_measured_dry_run_of_grouped_experts_outside_bf16_is_a_one_line_problem(ep):
    """transformers runs the Mixtral's experts as grouped matmuls, whose fake kernel
    takes bf16 only: an fp32 plan's measured dry run reports that in one line, at any ep,
    before running a step (it had failed inside the step with torch's traceback)."""
    from test_models import make, mixtral

    from autopar.runtime.dry_run import dry_run

    report = dry_run(_meta_mixtral, with_ep(make(mixtral(), dp=2, zero_stage=3), ep), measure=True)
    (problem,) = report.problems
    assert "in fp32: transformers runs them as grouped matmuls" in problem and "\n" not in problem
    assert not report.ranks


def test_hsdp_shards_the_experts_within_a_shard_group_and_trains_like_one_process():
    """8 ranks, dp=8 in 2 replicate groups of shard groups of 4, ep=2: an ep group is 2
    consecutive ranks of a shard group; FSDP2 shards each expert over the 2 ranks of its
    shard group holding it (``ep_shard``) and replicates it across the groups. Each rank
    keeps a quarter of the dense momentum and of its experts', half of the routers'."""
    plan = with_ep(make_plan(NAME, dp=8, zero_stage=3, dp_shard=4), 2)
    assert (plan.config.expert_replicas, plan.config.expert_state_shards) == (4, 2)
    results = run(train, 8, NAME, plan, STEPS, 0.5, None, None, 0.9, timeout_s=150)
    assert_parity(results, reference(NAME, plan, STEPS, clip=0.5, momentum=0.9))
    router = sum(p.numel() for n, p in build(NAME).named_parameters() if n.endswith(".router"))
    expected = (_total_numel() - router - _expert_numel()) // 4 + _expert_numel() // 2 // 2 + router // 2
    assert [r.extra["optimizer_state_numel"] for r in results] == [expected] * 8


def _normal_init(unit):
    """N(0, 0.02) matrices (the stacked experts included), unit norm scales."""
    for p in unit.parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
        else:
            torch.nn.init.ones_(p)


@pytest.mark.parametrize("config", [dict(dp=2), dict(dp=4, zero_stage=3)])
def test_a_meta_model_fills_its_expert_shards_with_the_seeded_values(config):
    """Built on the meta device: each rank keeps its experts (and under ZeRO-3 its FSDP
    shard of them) on meta and fills them from the same per-unit seeded init as one process."""
    from autopar.runtime.init import initialize

    plan = with_ep(make_plan(NAME, **config), 2)
    ref_model = initialize(build(NAME, "meta"), plan.model.units, _normal_init, seed=7)
    meta = functools.partial(build, NAME, "meta")
    results = run(train, plan.config.world_size, NAME, plan, STEPS, None, meta, _normal_init, 0.0, 7)
    assert_parity(results, reference(NAME, plan, STEPS, model=ref_model))
