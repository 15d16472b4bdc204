"""Mixture of experts: the grouped matmul FLOP formula against per-group plain matmuls,
a tiny Mixtral's forward against the closed-form count and backward against twice
forward, the plan note for an op with no formula, and autopar's own MoE model (routing
against a per-token loop, FLOPs against the closed form, experts replicated under
tensor parallelism)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import autopar
from autopar.graph import extract
from autopar.graph.flops import EXTRA_FLOP_FORMULAS, op_flops
from autopar.models import MoEConfig, MoELlama, build_named_model
from autopar.runtime.layouts import resolve
from autopar.vocab import Layout
from profiler.census import FlopLap

transformers = pytest.importorskip("transformers")

# a tiny Mixtral: hidden h, expert width f, E experts of which k per token, vocabulary V
H, F_, E, K, V, LAYERS, HEADS, KV_HEADS = 64, 128, 4, 2, 100, 2, 4, 2


def _mixtral() -> nn.Module:
    cfg = transformers.MixtralConfig(
        hidden_size=H,
        intermediate_size=F_,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=V,
        num_local_experts=E,
        num_experts_per_tok=K,
        max_position_embeddings=64,
    )
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(cfg)


def _mixtral_fwd_flops_per_token(seq: int) -> int:
    """Per token: q and o projections (h x h), k and v (h x kv), attention scores and
    values over ``seq`` keys (the fused kernel's formula counts the full square), the
    router (h x E), k experts of three h x f matmuls, and the vocabulary head."""
    kv = H // HEADS * KV_HEADS
    block = 2 * (2 * H * H) + 2 * (2 * H * kv) + 4 * seq * H + 2 * H * E + K * 3 * (2 * H * F_)
    return LAYERS * block + 2 * H * V


def test_grouped_mm_counts_what_its_groups_count_as_plain_matmuls():
    mm = flop_registry[torch.ops.aten.mm]
    a, w = torch.randn(40, 16, dtype=torch.bfloat16), torch.randn(3, 16, 24, dtype=torch.bfloat16)
    offs = torch.tensor([8, 24, 40], dtype=torch.int32)
    out = torch._grouped_mm(a, w, offs=offs)
    groups = [a[0:8], a[8:24], a[24:40]]
    expected = sum(mm(g, w[i], out_val=g @ w[i]) for i, g in enumerate(groups))
    assert op_flops(torch.ops.aten._grouped_mm.default, (a, w), {"offs": offs}, out) == expected
    # the count does not depend on how the rows are split between the experts
    skewed = torch.tensor([0, 0, 40], dtype=torch.int32)
    assert op_flops(torch.ops.aten._grouped_mm.default, (a, w), {"offs": skewed}, out) == expected


class _ByOp(TorchDispatchMode):
    """FLOPs per op packet, by autopar's lookup."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[str, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        n = op_flops(func, args, kwargs, out)
        if n:
            name = str(func._overloadpacket)
            self.flops[name] = self.flops.get(name, 0.0) + n
        return out


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_tiny_mixtral_forward_counts_its_experts(dtype):
    """In fp32 too: torch's shape function of grouped matmuls takes only bf16, the trace
    takes the shape in bf16 (the CPU kernel runs fp32, as the runtime tests do)."""
    seq = 32
    graph = extract(_mixtral(), seq_len=seq, dtype=dtype)
    assert graph.fwd_flops_per_sample / seq == pytest.approx(_mixtral_fwd_flops_per_token(seq), rel=1e-12)
    assert graph.uncounted_ops == ()


def test_grouped_mm_backward_is_twice_its_forward_in_a_mixtral():
    seq = 32
    cfg_model = _mixtral()
    real = type(cfg_model)(cfg_model.config).to(torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        ids = torch.zeros(1, seq, dtype=torch.long)
        fwd, bwd = _ByOp(), _ByOp()
        with fwd:
            loss = real(input_ids=ids, use_cache=False).logits.float().sum()
        with bwd:
            loss.backward()
    grouped = "aten._grouped_mm"
    expert_fwd = LAYERS * seq * K * 3 * (2 * H * F_)
    assert fwd.flops[grouped] == expert_fwd
    assert bwd.flops[grouped] == 2 * expert_fwd
    # FlopCounterMode given the same table agrees
    with FakeTensorMode(allow_non_fake_inputs=True):
        with FlopCounterMode(display=False, custom_mapping=dict(EXTRA_FLOP_FORMULAS)) as counter:
            real(input_ids=torch.zeros(1, seq, dtype=torch.long), use_cache=False)
    assert counter.get_flop_counts()["Global"][torch.ops.aten._grouped_mm] == expert_fwd


def test_the_profilers_census_counts_grouped_matmuls_as_the_trace_does():
    """Real CPU tensors: the forward's grouped matmul, and the backward's two."""
    a = torch.randn(40, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3, 16, 24, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([8, 24, 40], dtype=torch.int32)
    lap = FlopLap()
    lap.begin("fwd")
    out = torch._grouped_mm(a, w, offs=offs)
    lap.end("fwd")
    lap.begin("bwd")
    out.backward(torch.randn_like(out))
    lap.end("bwd")
    assert lap.flops == {"fwd": 2 * 40 * 16 * 24, "bwd": 2 * (2 * 40 * 16 * 24)}


def test_models_without_custom_kernels_have_no_uncounted_op():
    """No false alarm: lookups, joins (ViT's class token) and elementwise ops on weights
    are not reported."""
    vit_cfg = transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32, patch_size=8
    )
    gpt2_cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        vit = transformers.ViTForImageClassification(vit_cfg)
        gpt2 = transformers.GPT2LMHeadModel(gpt2_cfg)
    assert extract(vit, sample_input=torch.zeros(1, 3, 32, 32, device="meta")).uncounted_ops == ()
    assert extract(gpt2, seq_len=32).uncounted_ops == ()
    assert extract(build_named_model("llama2-7b"), seq_len=64).uncounted_ops == ()


@torch.library.custom_op("autopar_test::opaque_linear", mutates_args=())
def _opaque_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


@_opaque_linear.register_fake
def _(x, w):
    return x.new_empty(*x.shape[:-1], w.shape[0])


class _OpaqueLinear(nn.Module):
    """A linear layer run by a custom kernel that PyTorch has no FLOP formula for."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(16, 16))

    def forward(self, x):
        return _opaque_linear(x, self.weight)


class _Opaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = _OpaqueLinear()
        self.head = nn.Linear(16, 4, bias=False)

    def forward(self, x):
        return self.head(self.proj(x))


def test_an_op_without_formula_that_reads_weights_is_named_in_the_plan_notes():
    with torch.device("meta"):
        model = _Opaque()
    plan = autopar.plan(model, "dgx-a100-80gb:1", global_batch_size=8, sample_input=torch.zeros(1, 16), top=0)
    notes = [n for n in plan.notes if "0 FLOPs" in n]
    assert len(notes) == 1 and "autopar_test.opaque_linear" in notes[0]
    # the head alone: forward and backward (twice the forward) of a 16 x 4 matmul
    assert plan.model.flops_per_sample == pytest.approx(3 * 2 * 16 * 4, rel=1e-12)


MOE = MoEConfig(
    vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, n_experts=4, top_k=2
)


def _routed_one_token_at_a_time(ff: nn.Module, h: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """Each token's top-k experts in token order, skipping an expert whose capacity
    for this sample is used up; outputs weighted by the renormalised probabilities."""
    probs = torch.softmax(h @ ff.router.t(), dim=-1)
    weights, chosen = probs.topk(cfg.top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    w1, w3, w2 = ff.w1, ff.w3, ff.w2
    out = torch.zeros_like(h)
    for b in range(h.shape[0]):
        used = [0] * cfg.n_experts
        for t in range(h.shape[1]):
            for j in range(cfg.top_k):
                e = int(chosen[b, t, j])
                if used[e] < cfg.capacity(h.shape[1]):
                    v = h[b, t]
                    out[b, t] += weights[b, t, j] * ((F.silu(v @ w1[e]) * (v @ w3[e])) @ w2[e])
                used[e] += 1
    return out


@pytest.mark.parametrize("capacity_factor", [1.0, 0.5, 2.0])
def test_moe_routing_equals_a_per_token_loop(capacity_factor):
    cfg = dataclasses.replace(MOE, capacity_factor=capacity_factor)
    torch.manual_seed(0)
    ff = MoELlama(cfg).layers["0"].feed_forward
    h = torch.randn(3, 16, 32)
    expected = _routed_one_token_at_a_time(ff, h, cfg)
    torch.testing.assert_close(ff(h), expected, rtol=1e-5, atol=1e-6)
    # a sample is routed the same whatever else is in its batch
    torch.testing.assert_close(ff(h[1:2]), ff(h)[1:2], rtol=1e-5, atol=1e-6)


def test_moe_forward_flops_are_the_closed_form():
    """Per token: q and o (d x d), k and v (d x kv), attention over the sequence, the
    router (d x E), capacity_factor x top_k experts of three d x f matmuls, the head."""
    for capacity_factor in (1.0, 1.5):
        cfg = dataclasses.replace(MOE, capacity_factor=capacity_factor)
        with torch.device("meta"):
            model = MoELlama(cfg)
        seq = cfg.seq_len
        graph = extract(model, seq_len=seq)
        d, f, kv = cfg.dim, cfg.ffn_dim, cfg.head_dim * cfg.n_kv_heads
        slots_per_token = cfg.capacity(seq) * cfg.n_experts / seq  # top_k x capacity_factor
        assert slots_per_token == cfg.top_k * capacity_factor
        block = 2 * (2 * d * d) + 2 * (2 * d * kv) + 4 * seq * d + 2 * d * cfg.n_experts
        block += slots_per_token * 3 * (2 * d * f)
        assert graph.fwd_flops_per_sample / seq == pytest.approx(cfg.n_layers * block + 2 * d * cfg.vocab_size)
        assert graph.uncounted_ops == ()


def test_mixtral_8x7b_plans_with_its_experts_replicated_under_tensor_parallelism():
    model = build_named_model("mixtral-8x7b")
    assert sum(p.numel() for p in model.parameters()) == 46_702_792_704  # Mixtral 8x7B's 46.7B
    plan = autopar.estimate(
        model, "dgx-h100:8", {"tp": 8, "pp": 8, "sequence_parallel": True}, global_batch_size=64, seq_len=4096
    )
    tp = plan.layer_strategies.tp
    assert tp["layers.0.attention.wq"].value == "column" and tp["layers.0.attention.wo"].value == "row"
    assert all(
        tp.get(f"layers.{i}.feed_forward", autopar.TPStyle.REPLICATE) is autopar.TPStyle.REPLICATE for i in range(32)
    )
    # the runtime resolves that layout: the experts compute on the whole sequence (the
    # norm before them gathers it) and hand their sequence shard to the residual stream
    layout = resolve(extract(model, seq_len=4096), dict(tp), sequence_parallel=True, tp=8)
    moe = layout.leaves["layers.0.feed_forward"]
    assert (moe.arrives, moe.output) == (Layout.R, Layout.Q)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_k=5), r"top_k=5 is not allowed with n_experts=4"),
        (dict(top_k=0), r"top_k=0 is not allowed"),
        (dict(capacity_factor=0.0), r"capacity_factor=0.0 is not allowed"),
    ],
)
def test_moe_config_refuses_impossible_routing(kwargs, message):
    with pytest.raises(autopar.ConfigError, match=message):
        dataclasses.replace(MOE, **kwargs)
