"""Model extraction against hand counts: FLOPs (Narayanan et al. 2021), saved activations
(Korthikanti et al. 2022 accounting, for this implementation), units and leaves."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar import ModelError
from autopar.graph import LeafKind, extract
from autopar.models import (
    GPT,
    CNNConfig,
    GPTConfig,
    Llama,
    LlamaConfig,
    MLPConfig,
    MLPStack,
    ResNet,
    build_named_model,
    get_named_model,
)

S, H, A, L, V = 64, 128, 4, 4, 256


def _gpt():
    return GPT(GPTConfig(vocab_size=V, seq_len=S, dim=H, n_layers=L, n_heads=A))


def test_gpt_flops_match_the_megatron_formula():
    g = extract(_gpt(), seq_len=S, dtype="fp32")
    matmul = sum(leaf.matmul_flops for u in g.units for leaf in g.profiles[u.profile].leaves)
    assert matmul == pytest.approx(L * 24 * S * H * H + 2 * S * H * V, rel=1e-12)
    attention = sum(f.attn_flops for u in g.units for f in g.profiles[u.profile].flows)
    assert attention == pytest.approx(L * 4 * S * S * H, rel=1e-12)


def test_gpt_units_leaves_and_tied_weights():
    g = extract(_gpt(), seq_len=S, dtype="fp32")
    assert g.unit_names == (
        "tok_embeddings+pos_embeddings",
        "layers.0",
        "layers.1",
        "layers.2",
        "layers.3",
        "norm+output",
    )
    assert len(g.profiles) == 3  # repeated blocks are analysed once
    block = g.profile_of(1)
    kinds = {leaf.name: leaf.kind for leaf in block.leaves}
    assert kinds["attention.wq"] is LeafKind.LINEAR and kinds["attention_norm"] is LeafKind.NORM
    heads = {leaf.name: (leaf.in_heads, leaf.out_heads) for leaf in block.leaves}
    assert heads["attention.wq"] == (0, A) and heads["attention.wo"] == (A, 0) and heads["feed_forward.w1"] == (0, 0)
    assert g.shared[0].numel == V * H  # tok_embeddings.weight is output.weight
    assert g.num_params == sum(p.numel() for p in _gpt().parameters())


def test_a_one_block_model_keeps_its_block_as_a_unit():
    # a ModuleList of one block never runs itself: the block is the unit, not the list
    g = extract(GPT(GPTConfig(vocab_size=64, seq_len=8, dim=32, n_layers=1, n_heads=2)), seq_len=8, dtype="fp32")
    assert g.unit_names == ("tok_embeddings+pos_embeddings", "layers.0", "norm+output")


def test_tensors_made_from_constants_carry_no_flow():
    """The loss's zero targets and materialized attention's causal mask are built inside a unit
    from nothing: they carry no activation, so the epilogue's flows are input -> norm ->
    head -> output only, and the row-parallel projection after attention takes only
    what q, k and v made. Each used to add a flow from the unit's input, which priced a
    backward all-gather of the input where its consumer is sharded (the vocabulary-
    sharded logits; the projection's sharded input)."""
    from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT

    g = extract(_gpt(), seq_len=S, dtype="fp32", attention="materialized")
    last = g.profile_of(len(g.units) - 1)
    assert [leaf.name for leaf in last.leaves] == ["norm", "output"]
    assert {(f.src, f.dst) for f in last.flows} == {(UNIT_INPUT, 0), (0, 1), (1, UNIT_OUTPUT)}
    block = g.profile_of(1)  # materialized attention builds its causal mask from ones().tril()
    into_wo = {f.src for f in block.flows if f.dst >= 0 and block.leaves[f.dst].name == "attention.wo"}
    assert UNIT_INPUT not in into_wo


def test_saved_activations_materialized_hand_count():
    """fp32, no dropout, per sample: inputs of ln1, the q/k/v projections (shared), wo,
    ln2, w1 and w2 (4h wide), the GELU input (4h), q, k and v; LayerNorm mean and rstd;
    softmax probabilities (a s^2) and the causal mask (s^2 booleans)."""
    g = extract(_gpt(), seq_len=S, dtype="fp32", attention="materialized")
    sh = S * H * 4
    expected = 16 * sh + 2 * 2 * S * 4 + A * S * S * 4 + S * S
    assert g.profile_of(1).saved_bytes == expected
    attn_core = sum(f.attn_saved_bytes for f in g.profile_of(1).flows)
    assert attn_core == A * S * S * 4 + S * S  # what selective recomputation drops


def test_flash_attention_keeps_no_scores():
    g = extract(_gpt(), seq_len=S, dtype="fp32", attention="flash")
    sh = S * H * 4
    base = 16 * sh + 2 * 2 * S * 4
    saved = g.profile_of(1).saved_bytes
    # plus the log-sum-exp (a s, fp32) and the RNG seeds of the fused kernel; its output
    # is laid out (b, s, heads, d), so the projection's input is a view of it: one storage
    assert base + A * S * 4 <= saved <= base + A * S * 4 + 64


@pytest.mark.parametrize("attention", ["flash", "materialized"])
def test_the_attention_core_keeps_its_saved_tensors_on_the_flows_it_runs_on(attention):
    """What the attention core saves (flash: its output and log-sum-exp, packed by
    autograd after the kernel ran; materialized: scores and probabilities) belongs to
    the flows from q, k and v to the output projection, where tensor parallelism shards
    it by heads. Charged to the next glue op instead, flash's landed on the residual add
    after the projection, replicated: a tp=4 block was predicted 15.6 MiB where it
    held 14.1. Flash's output, which the output projection keeps too (a view of it),
    is saved outside the core: what selective recomputation drops is the log-sum-exp;
    counted as the core's, the output was dropped too, and a 314B plan's rank of
    selectively recomputed blocks measured 0.78 GiB over its prediction."""
    g = extract(_gpt(), seq_len=S, dtype="fp32", attention=attention)
    prof = g.profile_of(1)
    names = [leaf.name for leaf in prof.leaves]
    wo = names.index("attention.wo")
    qkv = {names.index(f"attention.{w}") for w in ("wq", "wk", "wv")}
    carrying = {(f.src, f.dst) for f in prof.flows if f.attn_saved_bytes > 0}
    assert carrying == {(i, wo) for i in qkv}
    # flash: the log-sum-exp (a s, fp32) per sample and the seeds; its output (s h)
    # with its inputs on the same flows
    if attention == "flash":
        core = sum(f.attn_saved_bytes for f in prof.flows)
        assert A * S * 4 <= core <= A * S * 4 + 64
        into_wo = sum(f.saved_bytes for f in prof.flows if (f.src, f.dst) in carrying)
        assert into_wo == 4 * S * H * 4  # q, k and v, which the core reads, and its output


def test_bf16_halves_the_activations():
    f32 = extract(_gpt(), seq_len=S, dtype="fp32", attention="materialized").profile_of(1)
    b16 = extract(_gpt(), seq_len=S, dtype="bf16", attention="materialized").profile_of(1)
    assert b16.fwd_flops == f32.fwd_flops
    assert 0.45 * f32.saved_bytes < b16.saved_bytes < 0.6 * f32.saved_bytes


def test_llama_grouped_query_attention():
    cfg = LlamaConfig(vocab_size=V, seq_len=S, dim=H, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=352)
    g = extract(Llama(cfg), seq_len=S, dtype="fp32")
    block = g.profile_of(1)
    heads = {leaf.name: leaf.out_heads for leaf in block.leaves}
    assert heads["attention.wq"] == 8 and heads["attention.wk"] == 2 and heads["attention.wv"] == 2
    kv = 2 * H // 8
    per_layer = 2 * S * (2 * H * H + 2 * H * kv + 3 * H * 352)
    matmul = sum(leaf.matmul_flops for leaf in block.leaves)
    assert matmul == pytest.approx(per_layer, rel=1e-12)


def test_hf_gpt2_conv1d_and_fused_qkv():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=H, n_layer=2, n_head=A, n_positions=S, vocab_size=V)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    g = extract(model, seq_len=S, dtype="fp32")
    assert g.units[0].modules == ("transformer.wte", "transformer.wpe", "transformer.drop")
    assert g.units[-1].modules == ("transformer.ln_f", "lm_head")
    block = g.profile_of(1)
    c_attn = next(leaf for leaf in block.leaves if leaf.name == "attn.c_attn")
    assert c_attn.kind is LeafKind.LINEAR and (c_attn.in_features, c_attn.out_features) == (H, 3 * H)
    assert c_attn.out_heads == A  # q, k and v each carry A heads
    matmul = sum(leaf.matmul_flops for leaf in block.leaves)
    assert matmul == pytest.approx(24 * S * H * H, rel=1e-12)
    assert g.shared and g.shared[0].numel == V * H


def test_hf_llama_bert_bloom_extract():
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                hidden_size=H,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=8,
                num_key_value_heads=2,
                vocab_size=V,
                max_position_embeddings=S,
            )
        )
        bare_bert = transformers.BertModel(
            transformers.BertConfig(
                hidden_size=H,
                num_hidden_layers=2,
                num_attention_heads=A,
                intermediate_size=256,
                vocab_size=V,
                max_position_embeddings=S,
            )
        )
        bert = transformers.BertForMaskedLM(
            transformers.BertConfig(
                hidden_size=H,
                num_hidden_layers=2,
                num_attention_heads=A,
                intermediate_size=256,
                vocab_size=V,
                max_position_embeddings=S,
            )
        )
        bloom = transformers.BloomForCausalLM(
            transformers.BloomConfig(hidden_size=H, n_layer=2, n_head=A, vocab_size=V)
        )
    gl = extract(llama, seq_len=S, dtype="fp32")
    assert [u.fqn for u in gl.units[1:-1]] == ["model.layers.0", "model.layers.1"]
    assert {leaf.name: leaf.out_heads for leaf in gl.profile_of(1).leaves}["self_attn.k_proj"] == 2
    gbb = extract(bare_bert, seq_len=S, dtype="fp32")
    assert [u.fqn for u in gbb.units[1:-1]] == ["encoder.layer.0", "encoder.layer.1"] and not gbb.cuttable
    gb = extract(bert, seq_len=S, dtype="fp32")
    assert [u.fqn for u in gb.units[1:-1]] == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    go = extract(bloom, seq_len=S, dtype="fp32")
    assert len(go.units) == 4 and go.fwd_flops_per_sample > 0


def _attention_work(graph) -> tuple[float, float]:
    """A block's attention FLOPs as counted, and what the attention kernel computes."""
    flows = graph.profile_of(1).flows
    return sum(f.attn_flops for f in flows), sum(f.fused_attention_flops for f in flows)


def test_transformers_causal_models_trace_sdpa_as_a_real_run_calls_it():
    """transformers' Llama and GPT-2 on one unpadded sequence per row call SDPA with
    ``is_causal=True`` on real token ids; traced on fake tensors they did not (their
    packed-sequence check cannot read position ids there, and they built a mask), which
    priced the attention kernel at all of its score products. Now the kernel computes
    half, as in autopar's Llama of the same shape (its own SDPA call, is_causal=True). A
    sliding window narrower than the sequence still builds its mask (all work counted)."""
    transformers = pytest.importorskip("transformers")
    shape = {"hidden_size": H, "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": V}
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**shape, num_attention_heads=A, num_key_value_heads=2, max_position_embeddings=S)
        )
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=H, n_layer=2, n_head=A, vocab_size=V))
        windowed = transformers.MistralForCausalLM(
            transformers.MistralConfig(**shape, num_attention_heads=A, num_key_value_heads=2, sliding_window=S // 4)
        )
        own = Llama(LlamaConfig(vocab_size=V, seq_len=S, dim=H, n_layers=2, n_heads=A, n_kv_heads=2, ffn_dim=256))
    reference = _attention_work(extract(own, seq_len=S, dtype="fp32"))
    assert reference[1] == reference[0] / 2
    assert _attention_work(extract(llama, seq_len=S, dtype="fp32")) == reference
    counted, work = _attention_work(extract(gpt2, seq_len=S, dtype="fp32"))
    assert counted > 0 and work == counted / 2
    counted, work = _attention_work(extract(windowed, seq_len=S, dtype="fp32"))
    assert counted > 0 and work == counted


def test_cnn_units_and_conv_flops():
    cfg = CNNConfig(image_size=32, width=16, stages=2, blocks_per_stage=2, num_classes=10)
    g = extract(ResNet(cfg), sample_input=torch.zeros(2, 3, 32, 32), dtype="fp32")
    assert g.unit_names == ("stem", "layers.0", "layers.1", "layers.2", "layers.3", "head")
    stem_conv = g.profile_of(0).leaves[0]
    assert stem_conv.kind is LeafKind.OTHER
    assert stem_conv.matmul_flops == pytest.approx(2 * 3 * 16 * 9 * 32 * 32)  # per sample
    assert not any(p.has_attention for p in g.profiles)


def test_mlp_stack_and_plain_sequential():
    g = extract(
        MLPStack(MLPConfig(in_dim=8, dim=16, ffn_dim=32, n_layers=3, out_dim=4)),
        sample_input=torch.zeros(4, 8),
        dtype="fp32",
    )
    assert g.unit_names == ("inp", "layers.0", "layers.1", "layers.2", "out")
    seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    gs = extract(seq, sample_input=torch.zeros(3, 8), dtype="fp32")
    assert gs.unit_names == ("0", "1", "2", "3", "4")
    assert gs.profile_of(0).leaves[0].matmul_flops == pytest.approx(2 * 8 * 16)


def test_weights_are_read_once_per_call_activations_per_sample():
    """nn.Linear(8, 16) on a batch of 4 (addmm): the weight (8x16) and bias (16) are read
    once per call whatever the batch; input (4x8) and output (4x16) per sample."""
    seq = nn.Sequential(nn.Linear(8, 16))
    for batch in (1, 4):
        leaf = extract(seq, sample_input=torch.zeros(batch, 8), dtype="fp32").profile_of(0).leaves[0]
        assert leaf.weight_bytes == 4 * (8 * 16 + 16)
        assert leaf.fwd_bytes == 4 * (8 + 16)  # per sample


def test_trillion_parameter_model_on_meta():
    g = extract(build_named_model("gpt-1t"), seq_len=2048)
    assert g.num_params > 1.0e12 and len(g.units) == 130 and len(g.profiles) == 3


def test_real_weights_are_not_touched(tiny_gpt):
    before = {k: v.clone() for k, v in tiny_gpt.state_dict().items()}
    extract(tiny_gpt, seq_len=S)
    assert all(torch.equal(before[k], v) for k, v in tiny_gpt.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in tiny_gpt.modules())
    assert "forward" not in vars(tiny_gpt.layers["1"])


def test_input_errors():
    with pytest.raises(ModelError, match="exactly one of seq_len"):
        extract(_gpt())
    with pytest.raises(ModelError, match="has no nn.Embedding"):
        extract(MLPStack(MLPConfig()), seq_len=16)
    with pytest.raises(ModelError, match="tracing MLPStack on fake tensors failed"):
        extract(MLPStack(MLPConfig(in_dim=8)), sample_input=torch.zeros(2, 5))
    with pytest.raises(ModelError, match=r"batch dimension is 0 \(shape \(0, 8\)\); give at least one sample"):
        extract(MLPStack(MLPConfig(in_dim=8)), sample_input=torch.zeros(0, 8))  # a division by zero deeper in


@pytest.mark.parametrize("name", ["gpt2-small", "llama3-8b", "mlp-wide", "resnet-small"])
def test_meta_and_fake_tensor_traces_agree(name, monkeypatch):
    """A model on the meta device traces on meta tensors; the fake-tensor trace, which
    any other model takes, is the reference it must equal field for field."""
    extract_module = importlib.import_module("autopar.graph.extract")  # the package exports a function of that name
    named = get_named_model(name)
    kwargs = (
        {"seq_len": 256}
        if named.input_kind == "tokens"
        else {"sample_input": torch.zeros(2, *named.sample_shape, device="meta")}
    )
    taken = []
    real = extract_module.run_trace

    def spy(*args, on_meta, **kw):
        taken.append(on_meta)
        return real(*args, on_meta=on_meta, **kw)

    monkeypatch.setattr(extract_module, "run_trace", spy)
    on_meta = extract(build_named_model(name), **kwargs)
    monkeypatch.setattr(extract_module, "run_trace", lambda *a, on_meta, **kw: real(*a, on_meta=False, **kw))
    on_fake = extract(build_named_model(name), **kwargs)
    assert taken == [True]
    assert on_meta == on_fake


class _FakeOnly(nn.Module):
    """Runs only on fake tensors (as a library that skips data checks while tracing)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if not isinstance(x, torch._subclasses.FakeTensor):
            raise RuntimeError("this op needs data")
        return self.lin(x)


def test_a_meta_model_that_needs_fake_tensors_falls_back_to_them():
    with torch.device("meta"):
        model = _FakeOnly()
    g = extract(model, sample_input=torch.zeros(2, 8, device="meta"), dtype="fp32")
    assert g.profile_of(0).leaves[0].matmul_flops == pytest.approx(2 * 8 * 8)


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_norms_between_projections_and_attention(family):
    """Qwen3 normalises each head of q and k (a weight of head_dim features), OLMo 2 the
    whole projections: either way q_proj and k_proj feed the attention's heads (32 and
    8 here), and only Qwen3's norms run on any whole heads (``per_head``)."""
    transformers = pytest.importorskip("transformers")
    sizes = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=32)
    sizes |= dict(num_key_value_heads=8, vocab_size=128, max_position_embeddings=64)
    if family == "qwen3":
        config, cls = transformers.Qwen3Config(**sizes, head_dim=8), transformers.Qwen3ForCausalLM
    else:
        config, cls = transformers.Olmo2Config(**sizes, pad_token_id=0), transformers.Olmo2ForCausalLM
    with torch.device("meta"):
        graph = extract(cls(config), seq_len=64)
    block = next(graph.profile_of(i) for i, u in enumerate(graph.units) if u.fqn == "model.layers.0")
    leaves = {leaf.name: leaf for leaf in block.leaves}
    assert (leaves["self_attn.q_proj"].out_heads, leaves["self_attn.k_proj"].out_heads) == (32, 8)
    q_norm, k_norm = leaves["self_attn.q_norm"], leaves["self_attn.k_norm"]
    assert q_norm.per_head == k_norm.per_head == (family == "qwen3")
    if family == "qwen3":
        assert (q_norm.out_heads, k_norm.out_heads) == (32, 8)


class _WindowedAttention(nn.Module):
    """One attention of 2 heads of 8 features, causal (``is_causal``) or under a boolean
    sliding-window mask of 16 positions (Gemma 3's sliding layers)."""

    def __init__(self, windowed: bool):
        super().__init__()
        self.qkv, self.o, self.windowed = nn.Linear(16, 48), nn.Linear(16, 16), windowed

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        if self.windowed:
            i = torch.arange(s, device=x.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 16)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, 16))


def test_a_boolean_mask_is_kept_as_torch_keeps_it():
    """F.scaled_dot_product_attention turns a boolean mask into an additive one in the
    query's dtype before any kernel, and the kernel keeps it for its backward: what the
    trace counts beside a causal attention is that tensor, as a real bf16 run on CPU
    saves it (read with saved-tensor hooks)."""
    seq = 64
    saved = []
    x = torch.randn(1, seq, 16, dtype=torch.bfloat16)
    real = _WindowedAttention(True).to(torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        real(x)
    bias = [t for t in saved if t.shape == (1, 1, seq, seq)]
    assert [t.dtype for t in bias] == [torch.bfloat16]  # the additive copy, not the boolean mask
    kept = {}
    for windowed in (False, True):
        model = nn.Sequential(_WindowedAttention(windowed))  # one block, its own unit
        graph = extract(model, sample_input=torch.zeros(1, seq, 16))
        kept[windowed] = sum(f.attn_saved_bytes for p in graph.profiles for f in p.flows)
    assert kept[True] - kept[False] == bias[0].numel() * bias[0].element_size() == 2 * seq * seq
