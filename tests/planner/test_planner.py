"""plan() and estimate(): behaviour a user relies on, and errors a user can act on."""

import dataclasses
import math
import re

import pytest
import torch

import autopar
from autopar import ConfigError, InfeasiblePlanError, Recompute, explain
from autopar.cost.peak import budget_bytes
from autopar.graph import extract
from autopar.models import GPT, GPTConfig, MLPConfig, MLPStack, build_named_model
from autopar.models.moe import MoEConfig, MoELlama
from autopar.present.whatif import fewest_nodes, time_to_train

from .exact_reference import tiny_cluster

DGX1 = autopar.preset("dgx-a100-80gb", nodes=1)


def test_plan_basics(gpt2_plan):
    p = gpt2_plan
    assert p.config.world_size == 8 and p.prediction.fits
    assert p.config.global_batch_size == 64
    assert 0.2 < p.prediction.mfu < 0.8 and p.prediction.hfu >= p.prediction.mfu
    assert p.prediction.memory_bytes_per_device <= DGX1.device.memory.capacity_bytes
    assert p.prediction.breakdown.total_s == pytest.approx(p.prediction.step_time_s, rel=1e-9)
    runners = [a for a in p.alternatives if a.status == "runner-up"]
    assert runners and all(a.step_time_s >= p.prediction.step_time_s for a in runners)
    text = explain(p)
    assert "Configuration" in text and "Why this plan" in text and "runners-up" in text


def test_constraints_are_honoured():
    m = build_named_model("gpt2-medium")
    p = autopar.plan(m, DGX1, global_batch_size=32, seq_len=1024, constraints={"tp": 2, "pp": 2})
    assert (p.config.tp, p.config.pp, p.config.dp) == (2, 2, 2)
    assert len(p.stages) == p.config.num_stages and sum(len(s) for s in p.stages) == len(p.model.units)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_estimate_of_a_schedule_of_several_stages_per_rank_runs_two(schedule):
    """A schedule that runs several stages per pipeline rank, given without their count,
    runs its fewest, two (it found no candidate with the one stage per rank the other
    defaults fill in, and said only that)."""
    m = build_named_model("llama3-8b")
    e = autopar.estimate(m, DGX1, {"pp": 4, "schedule": schedule}, global_batch_size=16, seq_len=1024)
    assert (e.config.schedule.value, e.config.virtual_stages, e.config.num_stages) == (schedule, 2, 8)
    one = autopar.estimate(m, DGX1, {"pp": 4}, global_batch_size=16, seq_len=1024)
    assert (one.config.schedule.value, one.config.virtual_stages) == ("1f1b", 1)
    # planned with the schedule pinned and pp free: only pipelines are candidates (a plan
    # without one came back as 1F1B, the pinned schedule dropped)
    planned = autopar.plan(m, DGX1, global_batch_size=16, seq_len=1024, constraints={"schedule": schedule})
    assert planned.config.pp > 1 and planned.config.schedule.value == schedule
    assert all(a.config.pp > 1 and a.config.schedule.value == schedule for a in planned.alternatives)


def test_estimate_is_a_space_of_size_one_and_never_raises_for_memory():
    m = build_named_model("gpt3-13b")
    e = autopar.estimate(
        m, DGX1, {"tp": 8, "micro_batch_size": 1, "recompute": "full"}, global_batch_size=8, seq_len=2048
    )
    assert (e.config.tp, e.config.dp, e.config.num_microbatches) == (8, 1, 8)
    assert e.config.recompute is Recompute.FULL
    huge = autopar.estimate(build_named_model("gpt3-175b"), DGX1, {"tp": 8}, global_batch_size=8, seq_len=2048)
    assert not huge.prediction.fits
    assert huge.prediction.memory_bytes_per_device > DGX1.device.memory.capacity_bytes


def test_infeasible_plan_names_the_memory():
    """A trillion parameters on one node: the least memory found, against the device's,
    and as many nodes as the states alone need: 16 bytes a parameter under Adam (fp32
    weights, gradients, two moments), over the 80 GB less the reserve of each device,
    by hand. Full recomputation was searched, so it is not suggested."""
    model = build_named_model("gpt-1t")
    with pytest.raises(InfeasiblePlanError, match=r"needs at least [\d.]+ GiB per device.*has 80.0 GiB") as err:
        autopar.plan(model, DGX1, global_batch_size=8, seq_len=2048)
    assert err.value.min_memory_bytes > err.value.capacity_bytes
    devices = math.ceil(sum(p.numel() for p in model.parameters()) * 16 / budget_bytes(DGX1.device.memory))
    least = math.ceil(devices / 8)
    found = re.search(
        rf"Try (\d+) nodes \(dp=.* fits there, .*; below {least} nodes none can: its weights, gradients and adam "
        rf"states alone fill {devices} devices, fully sharded; autopar plan --fewest-nodes "
        rf"\(autopar.present.whatif.fewest_nodes\) plans the counts between\)\.$",
        str(err.value),
    )
    assert found and "recompute='full'" not in str(err.value), str(err.value)
    with pytest.raises(InfeasiblePlanError, match=r"Try recompute='full' \(not enough alone\), or \d+ nodes \(dp="):
        autopar.plan(model, DGX1, global_batch_size=8, seq_len=2048, constraints={"recompute": "none"})


def test_tp_only_where_shapes_allow():
    """A refused tp names what it does not divide: the layer and its head count, or the
    device count."""
    model = GPT(GPTConfig(vocab_size=1000, seq_len=128, dim=768, n_layers=2, n_heads=12))
    cluster = autopar.preset("dgx-a100-80gb", nodes=2)
    heads = r"tp=16 does not fit: attention.wq splits by whole attention heads and has 12; allowed on 16 devices: "
    with pytest.raises(ConfigError, match=heads + r"\[1, 2, 4\]\.$"):
        autopar.plan(model, cluster, global_batch_size=16, seq_len=128, constraints={"tp": 16})
    with pytest.raises(ConfigError, match=r"tp=3 does not fit: it does not divide the 16 devices"):
        autopar.plan(model, cluster, global_batch_size=16, seq_len=128, constraints={"tp": 3})
    # grouped-query attention: 32 query heads divide by 16, the 8 KV heads do not
    llama = build_named_model("llama3-8b")
    with pytest.raises(
        ConfigError, match=r"tp=16 does not fit: attention.wk splits by whole attention heads and has 8;"
    ):
        autopar.plan(llama, cluster, global_batch_size=16, seq_len=128, constraints={"tp": 16})
    p = autopar.plan(model, cluster, global_batch_size=16, seq_len=128)
    assert p.config.tp in (1, 2, 4) and all(a.config.tp in (1, 2, 4) for a in p.alternatives)


def test_vocabulary_padding_is_reported():
    p = autopar.estimate(build_named_model("gpt2-small"), DGX1, {"tp": 4}, global_batch_size=8, seq_len=1024)
    assert any("50257 padded to 50688" in n for n in p.notes)


def test_uneven_stages():
    p = autopar.estimate(
        build_named_model("gpt-530b"),
        autopar.preset("dgx-a100-80gb", nodes=64),
        {"tp": 8, "pp": 8, "micro_batch_size": 1, "recompute": "full"},
        global_batch_size=64,
        seq_len=2048,
    )
    blocks = [sum(1 for u in s if u.startswith("layers.")) for s in p.stages]
    assert sum(blocks) == 105 and len(set(blocks)) > 1


def test_optimizer_and_attention_change_memory():
    m = build_named_model("gpt3-1.3b")
    kw = dict(global_batch_size=8, seq_len=2048)
    cfg = {"micro_batch_size": 1, "recompute": "none", "zero_stage": 0}
    mem = {
        opt: autopar.estimate(m, DGX1, cfg, optimizer=opt, **kw).prediction.memory_bytes_per_device
        for opt in ("adam", "sgd", "adafactor")
    }
    assert mem["adam"] > mem["sgd"] > mem["adafactor"]
    flash = autopar.estimate(m, DGX1, cfg, attention="flash", **kw).prediction
    mat = autopar.estimate(m, DGX1, cfg, attention="materialized", **kw).prediction
    assert mat.memory_bytes_per_device > flash.memory_bytes_per_device


def test_fewest_nodes_and_time_to_train():
    m = build_named_model("gpt3-13b")
    p = fewest_nodes(m, autopar.preset("dgx-a100-40gb"), global_batch_size=256, seq_len=2048)
    assert p.prediction.fits
    if p.cluster.nodes > 1:
        with pytest.raises(InfeasiblePlanError):
            autopar.plan(m, p.cluster.with_nodes(p.cluster.nodes - 1), global_batch_size=256, seq_len=2048)
    t = time_to_train(p, tokens=1e9)
    assert t.steps == -(-int(1e9) // (256 * 2048))
    assert t.device_hours == pytest.approx(t.seconds * p.config.world_size / 3600)
    # a configuration that does not fit has no training time; a path is not a plan
    crammed = autopar.estimate(m, p.cluster.with_nodes(1), {"tp": 1, "pp": 1}, global_batch_size=256, seq_len=2048)
    assert not crammed.prediction.fits
    with pytest.raises(ConfigError, match=r"^the plan does not fit: it predicts .* GiB per device"):
        time_to_train(crammed, tokens=1e9)
    with pytest.raises(ConfigError, match=r"^time_to_train\(\) takes a Plan .*, got str\.$"):
        time_to_train("plan.json", tokens=1e9)


def test_gpt3_175b_on_1024_a100():
    p = autopar.plan(
        build_named_model("gpt3-175b"),
        autopar.preset("dgx-a100-80gb", nodes=128),
        global_batch_size=1536,
        seq_len=2048,
    )
    assert p.config.world_size == 1024 and p.prediction.fits
    assert 0.3 < p.prediction.mfu < 0.8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(global_batch_size=0, seq_len=128), "global_batch_size=0"),
        (dict(global_batch_size=8, seq_len=-4), "seq_len=-4"),
        (dict(global_batch_size=8, seq_len=128, constraints={"tpp": 2}), r"unknown constraint\(s\) \['tpp'\]"),
        (dict(global_batch_size=8, seq_len=128, constraints={"schedule": "zigzag"}), "schedule='zigzag'"),
        (dict(global_batch_size=8, seq_len=128, constraints={"zero_stage": 5}), "zero_stage=5"),
        (dict(global_batch_size=7, seq_len=128, constraints={"dp": 8}), "global batch 7 is not divisible by dp=8"),
    ],
)
def test_bad_input_gets_a_clear_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        autopar.plan(GPT(GPTConfig(vocab_size=1000, seq_len=128, dim=64, n_layers=2, n_heads=4)), DGX1, **kwargs)


def test_non_token_models_plan_with_a_sample():
    model = MLPStack(MLPConfig(in_dim=64, dim=512, ffn_dim=2048, n_layers=4, out_dim=10))
    p = autopar.plan(model, DGX1, global_batch_size=64, sample_input=torch.zeros(1, 64))
    assert p.prediction.fits and p.model.seq_len == 1


class _ListStack(torch.nn.Module):
    """Blocks in an nn.ModuleList and a forward that loops over all of them."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_models_the_runtime_cannot_cut_get_pp_only_when_asked():
    """Left to itself, the search keeps such a model to pp=1 and its explanation says
    pipelining was left out and why; asked for pp=2, it plans it with a note that the
    runtime cannot run it."""
    cluster = autopar.preset("dgx-a100-80gb", nodes=1)
    sample = torch.zeros(1, 512)
    free = autopar.plan(_ListStack(), cluster, global_batch_size=16, sample_input=sample)
    assert free.config.pp == 1 and all(a.config.pp == 1 for a in free.alternatives)
    assert "Pipeline parallelism was left out: autopar's runtime cannot cut this model" in autopar.explain(free)
    asked = autopar.plan(_ListStack(), cluster, global_batch_size=16, sample_input=sample, constraints={"pp": 2})
    assert asked.config.pp == 2 and any("cannot cut this model" in n for n in asked.notes)
    ours = autopar.plan(
        build_named_model("gpt2-small"), cluster, global_batch_size=16, seq_len=256, constraints={"pp": 2}
    )
    assert not any("cannot cut" in n for n in ours.notes)


def test_transformers_decoders_are_offered_pipeline_splits():
    """transformers' decoders keep their blocks in a ModuleList, but the runtime runs
    their stages by the model's own forward (autopar.runtime.decoder_stages): pipelines
    are in their search space, as for autopar's own GPT (every family:
    tests/runtime/test_decoder_stages.py)."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_embd=256, n_layer=4, n_head=4, n_positions=256, vocab_size=1024)
        )
    cluster = autopar.preset("dgx-a100-80gb", nodes=1)
    assert extract(model, seq_len=256).cuttable and not extract(_ListStack(), sample_input=torch.zeros(1, 512)).cuttable
    asked = autopar.plan(model, cluster, global_batch_size=16, seq_len=256, constraints={"pp": 2})
    assert asked.config.pp == 2 and not any("cannot cut" in n for n in asked.notes)


class _NoParameters(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x)


def test_a_model_without_parameters_is_refused():
    """Nothing to train, shard or synchronise: planned, it would fail at run time."""
    cluster = autopar.preset("local-cpu", devices_per_node=2)
    with pytest.raises(autopar.ModelError, match="_NoParameters has no parameters"):
        autopar.plan(_NoParameters(), cluster, global_batch_size=8, sample_input=torch.zeros(1, 16))


def test_ddp_must_also_fit_its_bucket_rebuild():
    """DDP holds its gradients twice for a moment (``autopar.cost.memory``): with room for
    weights, gradients and AdamW's moments (4 x 4 bytes per parameter) plus the few KiB
    of activations, but not for a fifth copy, plain DDP does not fit and the search says
    so, while ZeRO-1 (half the moments on each of 2 ranks) fits."""
    model = MLPStack(MLPConfig(in_dim=64, dim=256, ffn_dim=1024, n_layers=2, out_dim=8))
    params = sum(p.numel() for p in model.parameters())
    local = autopar.preset("local-cpu", devices_per_node=2)
    room = 4.5 * 4 * params  # between the steady peak (4 copies) and the rebuild (5)
    memory = local.device.memory
    device = dataclasses.replace(
        local.device,
        memory=dataclasses.replace(memory, capacity_bytes=memory.reserved_bytes + room * (1 + memory.fragmentation)),
    )
    cluster = dataclasses.replace(local, device=device)
    ddp = {"dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 4, "zero_stage": 0}
    kwargs = {"global_batch_size": 8, "sample_input": torch.zeros(1, 64)}
    est = autopar.estimate(model, cluster, ddp, **kwargs)
    mem = est.prediction.stages[0].memory
    assert not est.prediction.fits
    assert mem.total_bytes - mem.reserve_bytes == pytest.approx(5 * 4 * params, rel=0.01)
    with pytest.raises(InfeasiblePlanError):
        autopar.plan(model, cluster, constraints=ddp, **kwargs)
    p = autopar.plan(model, cluster, constraints={"dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 4}, **kwargs)
    assert p.config.zero_stage >= 1 and p.prediction.fits


def test_an_estimate_says_it_searched_nothing():
    """An estimate prices the configuration given: its explanation said 'Why this plan
    (0 configurations costed ...; the search is exact ...)' and, where it did not fit,
    listed the same configuration as rejected at another size than the one it printed."""
    model = build_named_model("llama3-70b")
    cluster = autopar.preset("dgx-h100", nodes=4)
    est = autopar.estimate(model, cluster, {"tp": 8, "pp": 2}, global_batch_size=64, seq_len=8192)
    text = explain(est)
    assert not est.prediction.fits and not est.settings.searched and est.candidates_evaluated == 1
    assert "(nothing searched)" in text and "Why this plan" not in text and "rejected" not in text
    assert autopar.Plan.from_json(est.to_json()).settings.searched is False
    planned = autopar.plan(build_named_model("gpt2-small"), DGX1, global_batch_size=8, seq_len=128)
    assert planned.settings.searched and "Why this plan" in explain(planned)


def test_stages_per_rank_are_honoured_or_refused():
    """virtual_stages=3 was silently dropped: the plan had no pipeline. It now takes a
    pipeline of three stages per rank, or none is found."""
    plan = autopar.plan(build_named_model("gpt2-small"), DGX1, global_batch_size=8, seq_len=128,
                        constraints={"virtual_stages": 3})  # fmt: skip
    assert plan.config.pp > 1 and plan.config.virtual_stages == 3


def test_runners_up_say_their_recomputation_per_unit_and_estimate_the_same(tmp_path):
    """GPT-2 medium on 8 V100 cut to 8 GiB: some runners-up recompute some blocks and not
    others. Each says the mode most of its units take and how many take which other
    (``recompute=none(8 op)``), and its configuration given to ``estimate`` with the
    recomputation left to the search prices the same step and choice. Before, a
    runner-up said the searched default (``recompute=none``), which re-estimated as
    given recomputes nothing and does not fit."""
    base = autopar.preset("p3.16xlarge", nodes=1)
    memory = dataclasses.replace(base.device.memory, capacity_bytes=8 * 2**30)
    cluster = dataclasses.replace(base, device=dataclasses.replace(base.device, memory=memory))
    model = build_named_model("gpt2-medium")
    plan = autopar.plan(model, cluster, global_batch_size=64, seq_len=1024)
    mixed = [a for a in plan.alternatives if a.status == "runner-up" and a.unit_recompute]
    assert mixed
    units = extract(model, seq_len=1024).units
    for a in mixed:
        fields = ("dp", "tp", "pp", "micro_batch_size", "num_microbatches", "schedule", "zero_stage", "dtype")
        given = {f: getattr(a.config, f) for f in fields} | {"compile": a.config.compile}
        again = autopar.estimate(model, cluster, given, global_batch_size=64, seq_len=1024)
        assert again.prediction.step_time_s == pytest.approx(a.step_time_s, rel=1e-9)
        counts = {m: 0 for m in Recompute}
        for unit in units:  # a unit's modules (GPT's two embeddings) share its mode
            counts[again.layer_strategies.recompute.get(unit.modules[0], again.config.recompute)] += 1
        assert again.config.recompute is a.config.recompute
        assert {m: n for m, n in counts.items() if n and m is not a.config.recompute} == dict(a.unit_recompute)
        text = ",".join(f"{n} {m.value}" for m, n in sorted(a.unit_recompute.items(), key=lambda kv: kv[0].value))
        assert f"recompute={a.config.recompute.value}({text})" in a.short()
        as_given = autopar.estimate(model, cluster, given | {"recompute": "none"}, global_batch_size=64, seq_len=1024)
        if a.config.recompute is Recompute.NONE:
            assert not as_given.prediction.fits  # every unit without recomputation does not fit
    assert any("(" in line for line in explain(plan).splitlines() if "recompute=" in line)
    assert autopar.Plan.load(plan.save(tmp_path / "plan.json")).alternatives == plan.alternatives


def test_an_estimate_is_titled_as_one():
    """explain() titles a searched plan ``autopar plan:`` and a priced configuration
    ``autopar estimate:`` (it said ``autopar plan:`` for both)."""
    model = build_named_model("gpt2-small")
    searched = autopar.plan(model, DGX1, global_batch_size=16, seq_len=256)
    given = autopar.estimate(model, DGX1, {"dp": 8}, global_batch_size=16, seq_len=256)
    assert explain(searched).startswith("autopar plan: GPT (")
    assert explain(given).startswith("autopar estimate: GPT (")


def test_a_tensor_parallel_plan_that_splits_no_layer_says_so():
    """A 64-wide GPT on H100 at tp=2: every layer's split costs more than it saves, so the
    search replicates all of them; the explanation says so under the degree, which alone
    read as tensor parallelism in use (no section was printed)."""
    model = GPT(GPTConfig(vocab_size=256, seq_len=64, dim=64, n_layers=2, n_heads=2))
    plan = autopar.estimate(model, autopar.preset("dgx-h100", nodes=1), {"tp": 2}, global_batch_size=8, seq_len=64)
    assert plan.config.tp == 2 and not plan.layer_strategies.tp
    text = explain(plan).splitlines()
    at = text.index("Tensor parallelism (tp=2)")
    assert text[at + 1] == "  no layer is split: every layer is replicated over the 2 tensor-parallel ranks"


def test_infeasible_plan_sizes_its_best_case_and_the_nodes_it_needs():
    """A GPT whose states (16 bytes a parameter, 204 MiB) fit 4 devices of 60 MiB fully
    sharded, but not beside its activations: the best case is sized at its smallest
    options (above the device, not the device's own size, which a candidate whose
    stages found no fitting split carries), and the nodes suggested are a count where a
    configuration fits with each unit at its smallest option: planned on them, it fits
    (an estimate from the states alone had been offered, which need not fit)."""
    model = GPT(GPTConfig(vocab_size=1000, seq_len=512, dim=512, n_layers=4, n_heads=8))
    cluster = tiny_cluster(60 / 1024)
    with pytest.raises(InfeasiblePlanError) as err:
        autopar.plan(model, cluster, global_batch_size=64, seq_len=512)
    assert err.value.min_memory_bytes > err.value.capacity_bytes == 60 * 2**20
    found = re.search(r"Try (\d+) nodes \((dp=.*) fits there, ([\d.]+) MiB per device with each unit", str(err.value))
    assert found, str(err.value)
    nodes = int(found.group(1))
    assert nodes > 1 and float(found.group(3)) <= 60
    plan = autopar.plan(model, dataclasses.replace(cluster, nodes=nodes), global_batch_size=64, seq_len=512)
    assert plan.prediction.fits
    # recomputation pinned off: its best case keeps every activation, and is sized so (it
    # was sized with full recomputation, the figure of a plan the user did not allow)
    with pytest.raises(InfeasiblePlanError) as kept:
        autopar.plan(model, cluster, global_batch_size=64, seq_len=512, constraints={"recompute": "none"})
    assert kept.value.min_memory_bytes > err.value.min_memory_bytes
    # 20 MiB devices: the states outgrow the node, so the count they need alone (a lower
    # bound, by hand) comes first, then a count where a configuration fits
    small = tiny_cluster(20 / 1024)
    with pytest.raises(InfeasiblePlanError) as err:
        autopar.plan(model, small, global_batch_size=64, seq_len=512)
    devices = math.ceil(sum(p.numel() for p in model.parameters()) * 16 / budget_bytes(small.device.memory))
    found = re.search(
        rf"Try (\d+) nodes \(dp=.* fits there, .*; below (\d+) nodes none can: .* states alone fill {devices} devices",
        str(err.value),
    )
    assert found and devices > 4, str(err.value)
    assert int(found.group(2)) == math.ceil(devices / 4) < int(found.group(1))
    plan = autopar.plan(model, dataclasses.replace(small, nodes=int(found.group(1))), global_batch_size=64, seq_len=512)
    assert plan.prediction.fits


def test_the_nodes_offered_for_unevenly_held_states_fit():
    """Experts split over ep=4 with dp=4 and tp=2 pinned: the expert states shard over
    dp / ep = 1 rank, so on one node they hold more than their share of every device.
    The refusal took the states as spread over all devices, counted the excess as
    activations that more nodes do not shrink, and offered only a shorter sequence; it
    now offers a count where a configuration of the pinned degrees fits, and it fits."""
    model = MoELlama(MoEConfig(vocab_size=256, seq_len=64, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=512))
    pinned = {"ep": 4, "tp": 2, "dp": 4}
    cluster = dataclasses.replace(tiny_cluster(40 / 1024), devices_per_node=8)
    with pytest.raises(InfeasiblePlanError) as err:
        autopar.plan(model, cluster, global_batch_size=64, seq_len=64, constraints=pinned)
    found = re.search(r"Try (\d+) nodes \(dp=4 tp=2 pp=\d+ ep=4 .* fits there", str(err.value))
    assert found, str(err.value)
    plan = autopar.plan(
        model,
        dataclasses.replace(cluster, nodes=int(found.group(1))),
        global_batch_size=64,
        seq_len=64,
        constraints=pinned,
    )
    assert plan.prediction.fits


def test_a_recompute_mode_without_a_majority_is_not_the_headline():
    """The configuration line names the most common mode and the modules that differ; when
    those outnumber it (Mixtral-8x22B: 24 modules none, 32 recomputing in three modes), it
    gives every mode's count instead of 'recompute none'."""
    p = autopar.estimate(build_named_model("gpt2-small"), DGX1, {"dp": 8}, global_batch_size=8, seq_len=1024)
    units = p.model.units
    assert len(units) == 16 and not p.layer_strategies.recompute
    few = {units[2]: Recompute.FULL, units[3]: Recompute.SELECTIVE}
    many = {u: Recompute.FULL if i < 6 else Recompute.SELECTIVE for i, u in enumerate(units[2:12])}
    text = {}
    for name, modes in (("few", few), ("many", many)):
        plan = dataclasses.replace(p, layer_strategies=dataclasses.replace(p.layer_strategies, recompute=modes))
        text[name] = next(line for line in explain(plan).splitlines() if line.startswith("Configuration"))
    assert text["few"].endswith("recompute none (1 unit(s) full, 1 unit(s) selective)")
    assert text["many"].endswith("recompute mixed over 16 modules: 6 full, 6 none, 4 selective")


def test_fewest_nodes_moves_to_the_count_a_refusal_found_and_is_the_fewest():
    """fewest_nodes now moves to the node count a refusal found a configuration fitting
    on (instead of only doubling), then bisects: its answer is still the fewest nodes
    that fit, checked against planning every count from 1 up (brute force)."""
    model = GPT(GPTConfig(vocab_size=1000, seq_len=512, dim=512, n_layers=4, n_heads=8))
    cluster = tiny_cluster(20 / 1024)
    with pytest.raises(InfeasiblePlanError) as err:
        autopar.plan(model, cluster, global_batch_size=64, seq_len=512)
    assert err.value.nodes_that_fit is not None and err.value.nodes_that_fit > 2
    brute = None
    for nodes in range(1, err.value.nodes_that_fit + 1):
        try:
            autopar.plan(model, cluster.with_nodes(nodes), global_batch_size=64, seq_len=512)
        except InfeasiblePlanError:
            continue
        brute = nodes
        break
    found = fewest_nodes(model, cluster, global_batch_size=64, seq_len=512)
    assert found.prediction.fits and found.cluster.nodes == brute
