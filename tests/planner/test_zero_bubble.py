"""Zero-bubble schedules in the plan: their validation, their stage placement, the
plan file round trip and the search that offers them."""

import dataclasses

import pytest
import torch

import autopar
from autopar import ConfigError, InfeasiblePlanError, Plan
from autopar.graph import extract
from autopar.models import Llama, LlamaConfig, build_named_model
from autopar.plan import ParallelConfig
from autopar.present.report import timeline_figure
from autopar.search.constraints import check_constraints
from autopar.search.space import enumerate_space
from autopar.vocab import Recompute, Schedule

DGX1 = autopar.preset("dgx-a100-80gb", nodes=1)

BASE = dict(dp=1, tp=1, pp=4, micro_batch_size=1, num_microbatches=8)


@pytest.mark.parametrize(
    "schedule, v, message",
    [
        ("zbv", 3, "schedule='zbv' runs exactly 2 stages per pipeline rank.*virtual_stages=3"),
        ("zbv", 1, "schedule='zbv' needs virtual_stages >= 2"),
        ("dualpipev", 3, "schedule='dualpipev' runs exactly 2 stages per pipeline rank.*virtual_stages=3"),
        ("interleaved-zb", 1, "schedule='interleaved-zb' needs virtual_stages >= 2"),
        ("1f1b", 2, "virtual_stages=2 needs schedule 'interleaved-1f1b', 'interleaved-zb', 'zbv' or 'dualpipev'"),
    ],
)
def test_virtual_stages_checked(schedule, v, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**BASE, schedule=schedule, virtual_stages=v)


def test_stages_of_rank_are_the_stages_placed_on_it():
    for schedule in Schedule:
        for pp in (1, 2, 3, 4, 8):
            for v in (2,) if schedule.v_shape else (1, 2, 3):
                n = pp * v
                for r in range(pp):
                    placed = tuple(i for i in range(n) if schedule.rank_of_stage(i, pp) == r)
                    assert schedule.stages_of_rank(r, pp, n) == placed, (schedule, pp, v, r)


def test_zero_bubble_needs_a_pipeline():
    with pytest.raises(ConfigError, match="schedule='zbv' needs pp >= 2"):
        ParallelConfig(**{**BASE, "pp": 1}, schedule="zbv", virtual_stages=2)


def test_v_placement():
    """ZB-V: rank r holds stages r and 2p - 1 - r (Qi et al. 2023, section 6); the other
    schedules place stage i on rank i mod p."""
    assert [Schedule.ZBV.rank_of_stage(i, 4) for i in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [Schedule.INTERLEAVED_ZB.rank_of_stage(i, 4) for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("schedule", ["interleaved-zb", "zbv", "dualpipev"])
def test_round_trip(pipelined_plan, schedule):
    config = dataclasses.replace(pipelined_plan.config, schedule=Schedule(schedule), virtual_stages=2)
    stages = pipelined_plan.stages
    cut = (stages[0][: len(stages[0]) // 2], stages[0][len(stages[0]) // 2 :])
    cut2 = (stages[1][: len(stages[1]) // 2], stages[1][len(stages[1]) // 2 :])
    plan = dataclasses.replace(pipelined_plan, config=config, stages=(*cut, *cut2))
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.config.schedule is Schedule(schedule)
    expected = ((0, 3), (1, 2)) if Schedule(schedule).v_shape else ((0, 2), (1, 3))
    assert (again.stage_of_rank(0), again.stage_of_rank(1)) == expected


def _tiny_llama():
    cfg = LlamaConfig(vocab_size=32000, seq_len=2048, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim=5632)
    with torch.device("meta"):
        return Llama(cfg)


def test_search_offers_zero_bubble_schedules():
    """With two stages per rank the search costs interleaved 1F1B, interleaved ZB, ZB-V
    and DualPipeV on the same split; deferring the weight gradients shortens the fill,
    so with the same (eager) blocks interleaved ZB beats interleaved 1F1B, and
    ``explain`` lists the others."""
    p = autopar.plan(
        _tiny_llama(),
        DGX1,
        global_batch_size=64,
        seq_len=2048,
        constraints={
            "pp": 4,
            "tp": 2,
            "virtual_stages": 2,
            "micro_batch_size": 1,
            "sequence_parallel": True,
            "compile": False,
        },
    )
    times = {a.config.schedule: a.step_time_s for a in p.alternatives if a.status == "runner-up"}
    times[p.config.schedule] = p.prediction.step_time_s
    assert set(times) == {Schedule.INTERLEAVED_1F1B, Schedule.INTERLEAVED_ZB, Schedule.ZBV, Schedule.DUALPIPEV}
    assert times[Schedule.INTERLEAVED_ZB] < times[Schedule.INTERLEAVED_1F1B]
    text = autopar.explain(p)
    assert all(f"{s.value}(v=2)" in text for s in times if s is not p.config.schedule)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_are_pinned_by_constraints(schedule):
    p = autopar.plan(
        _tiny_llama(), DGX1, global_batch_size=64, seq_len=2048, constraints={"pp": 4, "schedule": schedule}
    )
    assert p.config.schedule is Schedule(schedule) and p.config.virtual_stages == 2
    assert [s.pipeline_rank for s in p.prediction.stages] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert Plan.from_json(p.to_json()) == p
    fig = timeline_figure(p)  # the simulation knows no split backward: a note, not a wrong picture
    [ax] = fig.axes  # one bare axes holding the note, so that a notebook draws it
    assert not ax.axison and not ax.collections and f"{schedule} with 2 stages per rank" in ax.texts[0].get_text()


def test_dualpipev_needs_two_microbatches_per_rank():
    """torch's DualPipeV needs m >= 2p: with fewer the search offers it nowhere, and a
    pinned one finds no candidate."""
    graph = extract(_tiny_llama(), seq_len=2048)
    configs, _ = enumerate_space(graph, DGX1, 16, check_constraints({"pp": 4, "tp": 2, "virtual_stages": 2}))
    dualpipev = [c for c in configs if c.schedule is Schedule.DUALPIPEV]
    assert dualpipev and {c.num_microbatches for c in dualpipev} == {8, 16}
    assert any(c.num_microbatches == 4 for c in configs if c.schedule is Schedule.ZBV)
    with pytest.raises(
        ConfigError, match=r"dualpipev needs at least as many micro-batches as stages \(m=4 < 2 \* pp=8\)"
    ):
        autopar.plan(
            _tiny_llama(), DGX1, global_batch_size=4, seq_len=2048, constraints={"pp": 4, "schedule": "dualpipev"}
        )


def test_zero3_is_not_offered_with_zero_bubble():
    """The runtime refuses ZeRO-3 under a split backward, so the search leaves the pair
    out, and refuses it in one line when both are pinned."""
    graph = extract(_tiny_llama(), seq_len=2048)
    configs, _ = enumerate_space(graph, DGX1, 64, check_constraints({"pp": 2, "tp": 2, "virtual_stages": 2}))
    zero_bubble = [c for c in configs if c.schedule.zero_bubble]
    assert zero_bubble and {c.zero_stage for c in zero_bubble} == {0, 1, 2}
    assert any(c.zero_stage == 3 for c in configs if c.schedule is Schedule.INTERLEAVED_1F1B)
    for schedule in ("zbv", "dualpipev"):
        with pytest.raises(ConfigError, match=f"schedule='{schedule}' with zero_stage=3 is not offered"):
            check = check_constraints({"pp": 2, "schedule": schedule, "zero_stage": 3})
            enumerate_space(graph, DGX1, 64, check)


def test_v_schedules_are_not_offered_for_tied_weights():
    """GPT-2 ties its embedding and head: a V (ZB-V, DualPipeV) would put both in two
    stages of rank 0, which the runtime refuses, so the search leaves it out and refuses
    it when pinned."""
    gpt = build_named_model("gpt2-small")
    p = autopar.plan(gpt, DGX1, global_batch_size=64, seq_len=1024, constraints={"pp": 2, "virtual_stages": 2})
    offered = {a.config.schedule for a in p.alternatives} | {p.config.schedule}
    assert Schedule.INTERLEAVED_ZB in offered and not offered & {Schedule.ZBV, Schedule.DUALPIPEV}
    for schedule in ("zbv", "dualpipev"):
        with pytest.raises(ConfigError, match=f"schedule='{schedule}' cannot run this model: 'tok_embeddings'"):
            autopar.plan(gpt, DGX1, global_batch_size=64, seq_len=1024, constraints={"pp": 2, "schedule": schedule})


def test_zero_bubble_schedules_run_eager_blocks():
    """torch's zero-bubble schedules refuse stage modules that ran through torch.compile
    (``tests/runtime/test_zero_bubble.py`` shows both refusals): on a device that
    compiles, the search prices those schedules with eager blocks only, the plan says
    why, and a pinned pair is refused in one line, asynchronous TP (compiled) too."""
    assert DGX1.device.compiles
    graph = extract(_tiny_llama(), seq_len=2048)
    configs, _ = enumerate_space(graph, DGX1, 64, check_constraints({"pp": 2, "tp": 2, "virtual_stages": 2}))
    zero_bubble = [c for c in configs if c.schedule.zero_bubble]
    assert zero_bubble and not any(c.compile for c in zero_bubble)
    assert {c.compile for c in configs if c.schedule is Schedule.INTERLEAVED_1F1B} == {True}
    pinned, _ = enumerate_space(graph, DGX1, 64, check_constraints({"pp": 2, "virtual_stages": 2, "compile": True}))
    assert pinned and not any(c.schedule.zero_bubble for c in pinned)
    p = autopar.plan(_tiny_llama(), DGX1, global_batch_size=64, seq_len=2048, constraints={"pp": 4, "schedule": "zbv"})
    assert not p.config.compile and not any(a.status == "compile" for a in p.alternatives)
    assert "blocks run eager, as zbv needs them (torch 2.13 splits the backward" in autopar.explain(p)
    edited = dataclasses.replace(p, config=dataclasses.replace(p.config, compile=True))  # by hand: said, not hidden
    assert (
        "blocks compiled (torch.compile: element-wise ops fused between matmuls); torch does not run them under zbv"
        in (autopar.explain(edited))
    )
    for extra, drop in (({"compile": True}, "compile=False"), ({"async_tp": True, "tp": 2}, "async_tp=False")):
        with pytest.raises(
            ConfigError, match=f"schedule='interleaved-zb' with compile=True.* is not allowed.*use {drop} "
        ):
            check_constraints({"pp": 2, "schedule": "interleaved-zb", **extra})
    assert check_constraints({"pp": 2, "schedule": "zbv"})["compile"] is False


def test_zero_bubble_schedules_recompute_nothing_or_attention_cores():
    """torch's split backward reruns a checkpointed unit's forward once per group of
    parameters and refuses a second backward under per-operator checkpointing
    (``tests/runtime/test_zero_bubble.py``): a zero-bubble plan's units recompute
    nothing or the attention cores (materialized scores) where memory is tight, its
    refusal names the mode it was sized with, and a pinned pair is refused."""
    cfg = LlamaConfig(vocab_size=32000, seq_len=32768, dim=4096, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=11008)
    with torch.device("meta"):
        model = Llama(cfg)
    pinned = {"pp": 4, "tp": 1, "cp": 1, "micro_batch_size": 1}
    zbv = {**pinned, "schedule": "zbv"}
    p = autopar.plan(model, DGX1, global_batch_size=16, seq_len=8192, constraints=zbv, attention="materialized")
    assert {p.config.recompute, *p.layer_strategies.recompute.values()} == {Recompute.NONE, Recompute.SELECTIVE}
    free = autopar.plan(model, DGX1, global_batch_size=16, seq_len=32768, constraints=pinned)
    assert Recompute.OP in {free.config.recompute, *free.layer_strategies.recompute.values()}
    with pytest.raises(InfeasiblePlanError) as refused:
        autopar.plan(model, DGX1, global_batch_size=16, seq_len=32768, constraints=zbv)
    assert "zbv(v=2) zero=2 recompute=selective" in str(refused.value) and "recompute=full" not in str(refused.value)
    graph = extract(_tiny_llama(), seq_len=2048)
    for mode in ("full", "op"):
        configs, _ = enumerate_space(graph, DGX1, 64, check_constraints({"pp": 2, "recompute": mode}))
        assert configs and not any(c.schedule.zero_bubble for c in configs)
        with pytest.raises(ConfigError, match=f"schedule='zbv' with recompute='{mode}' is not allowed: torch 2.13"):
            check_constraints({"pp": 2, "schedule": "zbv", "recompute": mode})
