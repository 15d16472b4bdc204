"""Models beyond autopar's own: transformers' GPT2LMHeadModel (Conv1D layers, fused
c_attn split by heads), LlamaForCausalLM, OLMo 2, DeepSeek-V3 and Mixtral built from
small configs, against one process (autopar's ResNet: test_resnet.py)."""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from parity import LOSS_ATOL, LR, PARAM_ATOL, SEQ, VOCAB, RunResult, all_params, assert_parity, batches, resumable, run
from torch import nn

import autopar
from autopar.runtime.api import analyse, parallelize
from autopar.runtime.errors import ShardingError

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers")

LAYERS = 2


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=32,
            n_layer=LAYERS,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


TINY_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    use_cache=False,
    bos_token_id=0,
    eos_token_id=0,
)
"""The tiny transformers decoders' sizes."""
TINY_MOE = {**TINY_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}
"""The tiny mixtures of experts' sizes: 4 experts, top-2."""


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_DECODER))


def llama_cached():
    """A tiny Llama whose config keeps transformers' default ``use_cache=True``, as a
    config from a model hub does."""
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_DECODER, "use_cache": True}))


def mixtral():
    """A tiny Mixtral: transformers runs its 4 experts (top-2) as grouped matmuls."""
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**TINY_MOE))


def gpt_oss():
    """A tiny GPT-OSS: 4 experts (top-2) with biases, their weights stacked transposed to
    Mixtral's and their forward taking (hidden_states, router_indices, routing_weights)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**TINY_MOE, head_dim=8))
    for name, p in model.named_parameters():
        if name.endswith("_bias") and "experts" in name:
            torch.nn.init.normal_(p, std=0.1)  # zeros at init: values, so a misplaced bias would show
    return model


BUILD = {"gpt2": gpt2, "llama": llama, "llama-cached": llama_cached, "mixtral": mixtral, "gpt-oss": gpt_oss}


def hf_loss(output, target):
    """Cross-entropy on the logits (structured outputs arrive as their logits)."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def megatron(name, sp):
    """Megatron-LM layouts in each library's names."""
    if name == "gpt2":
        block = {"attn.c_attn": "column", "attn.c_proj": "row", "mlp.c_fc": "column", "mlp.c_proj": "row"}
        norms, prefix, ends = ("ln_1", "ln_2"), "transformer.h", {"transformer.wte": "vocab", "lm_head": "column"}
        final = "transformer.ln_f"
    else:
        block = {f"self_attn.{p}_proj": "column" for p in "qkv"} | {
            "self_attn.o_proj": "row",
            "mlp.gate_proj": "column",
            "mlp.up_proj": "column",
            "mlp.down_proj": "row",
        }
        norms, prefix, ends = (
            ("input_layernorm", "post_attention_layernorm"),
            "model.layers",
            {"model.embed_tokens": "vocab", "lm_head": "column"},
        )
        final = "model.norm"
    styles = dict(ends)
    for i in range(LAYERS):
        styles.update({f"{prefix}.{i}.{k}": v for k, v in block.items()})
        if sp:
            styles.update({f"{prefix}.{i}.{n}": "sequence" for n in norms})
    if sp:
        styles[final] = "sequence"
    return styles


def make(model, styles=None, sample=None, **config):
    config = {"dp": 1, "tp": 1, "pp": 1, "micro_batch_size": 2, "num_microbatches": 2, "dtype": "fp32", **config}
    world = config["dp"] * config["tp"] * config["pp"]
    gbs = config["dp"] * config["micro_batch_size"] * config["num_microbatches"]
    kwargs = {"sample_input": sample} if sample is not None else {"seq_len": SEQ}
    plan = autopar.estimate(
        model, autopar.preset("local-cpu", devices_per_node=world), config, global_batch_size=gbs, **kwargs
    )
    if styles is not None:
        plan = dataclasses.replace(
            plan,
            layer_strategies=dataclasses.replace(
                plan.layer_strategies, tp={k: autopar.TPStyle(v) for k, v in styles.items()}
            ),
        )
    return plan


def _built(model):
    """A model of BUILD by name, or from a builder (a picklable callable)."""
    return BUILD[model]() if isinstance(model, str) else model()


def hf_reference(name, plan, steps=5):
    model = _built(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches("gpt", steps, plan.config.global_batch_size):
        loss = hf_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return RunResult(
        losses=losses, params={n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    )


def hf_train(rank, world, name, plan, steps=5):
    job = parallelize(_built(name), plan, loss_fn=hf_loss)
    opt = job.optimizer(torch.optim.SGD, lr=LR)
    losses = []
    for batch in job.shard(batches("gpt", steps, plan.config.global_batch_size)):
        losses.append(job.step(batch))
        opt.step()
        opt.zero_grad()
    return RunResult(losses=losses, params=all_params(job))


def as_reference_shapes(results, ref):
    """GPT-2's fused c_attn is held as (in, 3, hidden) when split by heads (see
    autopar.runtime.hf); compare it in the library's (in, 3 x hidden) layout."""
    out = []
    for res in results:
        params = {
            n: v.reshape(ref.params[n].shape) if n.endswith(("c_attn.weight", "c_attn.bias")) else v
            for n, v in res.params.items()
        }
        out.append(dataclasses.replace(res, params=params))
    return out


@pytest.mark.parametrize(
    "name,case",
    [
        ("gpt2", "dp2"),
        ("gpt2", "tp2"),
        ("gpt2", "tp2-sp"),
        ("llama", "tp2-sp"),
        ("llama", "dp2-tp2"),
        ("gpt2", "pp2"),
        ("llama", "pp2"),
        ("gpt2", "dp2-pp2"),
        ("llama", "tp2-pp2-sp"),
        ("gpt2", "2x2x2"),
    ],
)
def test_transformers_models(name, case):
    """Each split against the unsplit single-process model. Pipeline stages run their
    share of transformers' forward (autopar.runtime.decoder_stages); GPT-2's head is
    tied to its token embedding across the two stages."""
    spec = {
        "dp2": dict(dp=2),
        "tp2": dict(tp=2),
        "tp2-sp": dict(tp=2, sequence_parallel=True),
        "dp2-tp2": dict(dp=2, tp=2, zero_stage=3),
        "pp2": dict(pp=2),
        "dp2-pp2": dict(dp=2, pp=2, zero_stage=3),
        "tp2-pp2-sp": dict(tp=2, pp=2, sequence_parallel=True),
        "2x2x2": dict(dp=2, tp=2, pp=2, zero_stage=2, sequence_parallel=True),
    }[case]
    styles = megatron(name, spec.get("sequence_parallel", False)) if spec.get("tp", 1) > 1 else None
    plan = make(BUILD[name](), styles, **spec)
    ref = hf_reference(name, plan)
    assert_parity(as_reference_shapes(run(hf_train, plan.config.world_size, name, plan, timeout_s=120), ref), ref)


@pytest.mark.parametrize("recompute", ["op", "full"])
def test_a_transformers_decoder_recomputes_with_its_default_key_value_cache(recompute):
    """A config's use_cache=True (transformers' default) builds a key/value cache in every
    forward: recomputing a layer ran its attention again against the cache the forward
    had filled, and per-operator recomputation failed at the first backward ("aten.slice
    ... not found in storage"). The runtime trains without the cache, as transformers'
    own gradient checkpointing does."""
    plan = make(llama_cached(), dp=2, recompute=recompute)
    ref = hf_reference("llama-cached", plan)
    assert_parity(run(hf_train, 2, "llama-cached", plan, timeout_s=120), ref)


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
@pytest.mark.parametrize("rows", ["kv", "qkv"])
def test_transformers_llama_with_row_parallel_projections(sp, rows):
    """k and v (or q, k and v) row-parallel, reduced into head shards for the attention:
    the planner's layout for Llama 3.1 70B and 405B at tp=4, whose 8 key/value heads
    make k and v small. transformers hands each layer its rotary tables as inputs, which
    the trace sees reaching the attention beside q; the dry run refused the plan
    ("summed with tensors in several layouts") until the reduction let the other
    projections decide, as the other meeting points do; with all three row-parallel it
    reduced them to sequence shards, which the attention cannot read."""
    styles = megatron("llama", sp)
    for i in range(LAYERS):
        for p in rows:
            styles[f"model.layers.{i}.self_attn.{p}_proj"] = "row"
    plan = make(llama(), styles, tp=2, sequence_parallel=sp)
    ref = hf_reference("llama", plan)
    assert_parity(run(hf_train, 2, "llama", plan, timeout_s=120), ref)


@pytest.mark.parametrize("mlp", ["split", "replicate"])
def test_transformers_llama_with_a_replicated_attention_under_sequence_parallelism(mlp):
    """q, k, v and o replicated, the MLP column then row (or replicated too), norms on
    sequence shards: o_proj's whole output met the sequence-sharded residual ("The size
    of tensor a (8) must match the size of tensor b (16)"). The runtime slices it to the
    rank's sequence shard before the add, as the planner prices it."""
    styles = megatron("llama", True)
    for i in range(LAYERS):
        for p in "qkvo":
            styles[f"model.layers.{i}.self_attn.{p}_proj"] = "replicate"
        if mlp == "replicate":
            styles.update({f"model.layers.{i}.mlp.{p}_proj": "replicate" for p in ("gate", "up", "down")})
    plan = make(llama(), styles, tp=2, sequence_parallel=True)
    ref = hf_reference("llama", plan, steps=3)
    assert_parity(run(hf_train, 2, "llama", plan, 3, timeout_s=120), ref)


def olmo2():
    """A tiny OLMo 2: its q_norm and k_norm normalise the whole query and key
    projections (not each head), before the attention."""
    torch.manual_seed(0)
    return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**TINY_DECODER, pad_token_id=0))


def _olmo2_styles(qk_norm: str) -> dict[str, str]:
    """The planner's OLMo 2 layout at tp=2 with sequence parallelism, its q_norm and
    k_norm given ``qk_norm``."""
    styles = megatron("llama", sp=True)
    for i in range(LAYERS):
        del styles[f"model.layers.{i}.input_layernorm"]  # OLMo 2 normalises after each sublayer
        styles[f"model.layers.{i}.post_feedforward_layernorm"] = "sequence"
        styles[f"model.layers.{i}.self_attn.v_proj"] = "row"
        for norm in ("q_norm", "k_norm"):
            styles[f"model.layers.{i}.self_attn.{norm}"] = qk_norm
    return styles


def test_olmo2_under_tensor_and_sequence_parallelism():
    """The planner's layout for OLMo 2 (q and k column-parallel, gathered for their
    whole-projection norms, v row-parallel) matches one process. Its previous layout
    ran those norms on sequence shards, so the attention read sequence shards: the
    runtime now refuses that (test_hf_cli: the planner no longer offers it)."""
    plan = make(olmo2(), _olmo2_styles("replicate"), tp=2, sequence_parallel=True)
    assert_parity(run(hf_train, 2, olmo2, plan, timeout_s=120), hf_reference(olmo2, plan))
    with pytest.raises(ShardingError, match="sequence shards, but attention reads every position"):
        analyse(olmo2(), make(olmo2(), _olmo2_styles("sequence"), tp=2, sequence_parallel=True))


def deepseek_v3(q_lora_rank: int | None = 24):
    """A tiny DeepSeek-V3: multi-latent attention (query and key/value latents, a rotary
    key part shared by the heads), a dense block, then a block of 4 routed experts. With
    ``q_lora_rank=None`` the queries are projected directly (``q_proj``), as in
    DeepSeek-V2-Lite."""
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(
            **{k: v for k, v in TINY_DECODER.items() if k != "num_key_value_heads"},
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            q_lora_rank=q_lora_rank,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
        )
    )


def test_deepseek_v3_latent_attention_under_tensor_parallelism():
    """The layout the planner gives DeepSeek-V3 at tp > 1 (its attention's projections
    row-parallel, the key/value projection replicated: it packs each head's key and
    value parts; the dense MLP and the shared experts column- then row-parallel) trains
    as one process does."""
    styles = {}
    for i in range(LAYERS):
        attention, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp" + (".shared_experts" if i else "")
        styles.update({f"{attention}.{n}": "row" for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")})
        styles.update({f"{mlp}.gate_proj": "column", f"{mlp}.up_proj": "column", f"{mlp}.down_proj": "row"})
    plan = make(deepseek_v3(), styles, tp=2)
    assert_parity(run(hf_train, 2, deepseek_v3, plan, timeout_s=120), hf_reference(deepseek_v3, plan))


@pytest.mark.parametrize("latents", ["replicate", "row", "direct queries"])
def test_deepseek_v3_latent_attention_split_by_heads(latents):
    """Megatron-LM's layout for multi-latent attention: the query and key/value up-
    projections column-parallel (each rank its heads: the key/value one packs each
    head's key and value parts, cut within the head), the output projection row-
    parallel, the latent down-projections and their norms replicated. The rotary key
    part, one head's worth from the replicated kv_a_proj_with_mqa, is expanded to the
    rank's heads beside its key shards: the runtime reduces its gradient (a sum over the
    rank's heads) over the group, and training matches one process. The down-
    projections may also run row-parallel (what the planner picks at tp=8 for
    DeepSeek-V3's sizes): their partial latents are all-reduced whole. Without a query
    latent (DeepSeek-V2-Lite) the query projection is split by heads itself."""
    direct = latents == "direct queries"
    build = functools.partial(deepseek_v3, q_lora_rank=None) if direct else deepseek_v3
    styles = {}
    for i in range(LAYERS):
        attention, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp" + (".shared_experts" if i else "")
        styles.update({f"{attention}.kv_b_proj": "column", f"{attention}.o_proj": "row"})
        if direct:
            styles[f"{attention}.q_proj"] = "column"
        else:
            styles.update({f"{attention}.q_b_proj": "column", f"{attention}.q_a_proj": latents})
            styles[f"{attention}.kv_a_proj_with_mqa"] = latents
        styles.update({f"{mlp}.gate_proj": "column", f"{mlp}.up_proj": "column", f"{mlp}.down_proj": "row"})
    plan = make(build(), styles, tp=2)
    layout = analyse(build(), plan).layout
    assert layout.leaves["model.layers.0.self_attn.kv_a_proj_with_mqa"].reduce_grad == (16, 20)  # the rotary part
    assert_parity(run(hf_train, 2, build, plan, timeout_s=120), hf_reference(build, plan))


@pytest.mark.parametrize("case", ["dp2", "pp2", "tp2", "tp2-sp"])
def test_transformers_mixtral(case):
    """A transformers mixture-of-experts model against the unsplit model: tokens route
    independently, so data and pipeline parallelism compute what one process does; under
    tensor parallelism the attention is split (Megatron-LM's layout) and the router and
    the experts (3-D weights, not Linear layers) stay replicated; with sequence
    parallelism the norm before them gathers the sequence and the MoE block hands its
    sequence shard to the residual stream."""
    spec = {"dp2": dict(dp=2), "pp2": dict(pp=2), "tp2": dict(tp=2), "tp2-sp": dict(tp=2, sequence_parallel=True)}
    spec = spec[case]
    styles = None
    if spec.get("tp", 1) > 1:
        attention = {f"model.layers.{i}.self_attn.{p}_proj": "column" for i in range(LAYERS) for p in "qkv"}
        rows = {f"model.layers.{i}.self_attn.o_proj": "row" for i in range(LAYERS)}
        styles = {**attention, **rows, "model.embed_tokens": "vocab", "lm_head": "column"}
    if spec.get("sequence_parallel"):
        norms = ("input_layernorm", "post_attention_layernorm")
        styles |= {f"model.layers.{i}.{n}": "sequence" for i in range(LAYERS) for n in norms}
        styles["model.norm"] = "sequence"
    plan = make(mixtral(), styles, **spec)
    ref = hf_reference("mixtral", plan)
    assert_parity(run(hf_train, plan.config.world_size, "mixtral", plan, timeout_s=120), ref)


class _ListStack(nn.Module):
    """Blocks in an nn.ModuleList and a forward that loops over all of them."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _refused(rank, world, plan):
    try:
        parallelize(_ListStack(), plan, loss_fn=F.mse_loss, sample_input=torch.zeros(1, 8))
    except autopar.AutoparError as exc:
        return type(exc).__name__, str(exc)
    return None


def test_a_pipeline_split_of_blocks_in_a_module_list_is_refused_on_every_rank():
    """A model whose forward loops over an nn.ModuleList cannot drop blocks, so a
    pipeline split is refused with a typed error before any collective (the planner
    does not offer one: LayerGraph.cuttable)."""
    plan = make(_ListStack(), sample=torch.zeros(1, 8), pp=2)
    for kind, message in run(_refused, 2, plan):
        assert kind == "PipelineError" and "sits in a ModuleList" in message


def _save_gpt2(rank, world, plan, path, steps):
    job = parallelize(gpt2(), plan, loss_fn=hf_loss)
    opt = job.optimizer(torch.optim.SGD, lr=LR)
    for batch in job.shard(batches("gpt", steps, plan.config.global_batch_size)):
        job.step(batch)
        opt.step()
        opt.zero_grad()
    job.save_checkpoint(path, step=steps)


def _load_gpt2(rank, world, plan, path):
    job = parallelize(gpt2(), plan, loss_fn=hf_loss)
    job.optimizer(torch.optim.SGD, lr=LR)
    job.load_checkpoint(path)
    return all_params(job)


def test_fused_qkv_checkpoint_loads_under_another_layout(tmp_path):
    """Saved with c_attn split by heads ((in, 3, hidden) DTensors, tp=2), loaded by a
    data-parallel job that holds it as the library's (in, 3 x hidden)."""
    saver = make(gpt2(), megatron("gpt2", False), tp=2)
    loader = make(gpt2(), dp=2, num_microbatches=1)
    run(_save_gpt2, 2, saver, str(tmp_path), 2)
    ref = hf_reference("gpt2", saver, steps=2)
    for params in run(_load_gpt2, 2, loader, str(tmp_path)):
        assert (
            params["transformer.h.0.attn.c_attn.weight"].shape == ref.params["transformer.h.0.attn.c_attn.weight"].shape
        )
        for name, value in params.items():
            torch.testing.assert_close(value, ref.params[name], rtol=0, atol=PARAM_ATOL)


def _hf_resumable(rank, world, name, plan, path, resume, steps, save_at):
    job = parallelize(BUILD[name](), plan, loss_fn=hf_loss)
    return resumable(job, job.optimizer(torch.optim.SGD, lr=LR), "gpt", path, resume, steps, save_at)[0]


def test_a_transformers_pipeline_checkpoint_resumes_under_tensor_parallelism(tmp_path):
    """GPT-2 saved by pp=2 stages (blocks held under their original names, the tied
    head on the last stage) and resumed by tp=2 with GPT-2's c_attn split by heads: the
    resumed losses continue the uninterrupted single-process run."""
    saver = make(gpt2(), pp=2, num_microbatches=4)
    loader = make(gpt2(), megatron("gpt2", False), tp=2, num_microbatches=4)
    ref = hf_reference("gpt2", saver, steps=4)
    first = run(_hf_resumable, 2, "gpt2", saver, str(tmp_path), False, 4, 2, timeout_s=120)
    second = run(_hf_resumable, 2, "gpt2", loader, str(tmp_path), True, 4, None, timeout_s=120)
    for losses in first:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses[:2]), rtol=0, atol=LOSS_ATOL)
    for losses in second:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses[2:]), rtol=0, atol=LOSS_ATOL)
