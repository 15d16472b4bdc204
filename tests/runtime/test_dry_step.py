"""A measured dry run counts on fake tensors what the same step allocates on real ones
(autopar.runtime.dry_step)."""

import dataclasses

import pytest
from parity import build, make_plan, megatron_styles, run

from autopar.runtime import dry_run as dry_run_module
from autopar.runtime.api import parallelize
from autopar.runtime.dry_run import dry_run
from autopar.runtime.dry_step import measure_step, measured_microbatches
from autopar.runtime.local import cross_entropy

pytestmark = pytest.mark.multiprocess


def _real(rank, world, plan, name="gpt"):
    job = parallelize(build(name), plan, loss_fn=cross_entropy, measure_memory=False)
    step = measure_step(job, plan, None)
    return step.peak_bytes, step.held_bytes


@pytest.mark.parametrize(
    "config",
    [
        {"dp": 2, "zero_stage": 3},
        {"dp": 2, "zero_stage": 2, "num_microbatches": 4},
        {"tp": 2, "styles": megatron_styles("gpt", sequence_parallel=True), "sequence_parallel": True},
        {"pp": 2, "num_microbatches": 4},
        {"pp": 2, "num_microbatches": 4, "schedule": "interleaved-1f1b", "virtual_stages": 2},
        {"dp": 2, "zero_stage": 1, "dtype": "bf16"},
        {"pp": 2, "num_microbatches": 4, "dtype": "bf16"},
        # DualPipeV's V puts the first and last stage on rank 0: a model with untied weights
        {"model": "llama", "pp": 2, "num_microbatches": 4, "schedule": "dualpipev", "virtual_stages": 2},
    ],
    ids=["zero3", "zero2", "tp-sp", "pp-1f1b", "pp-interleaved", "zero1-bf16", "pp-bf16", "pp-dualpipev"],
)
def test_a_fake_step_allocates_what_the_same_step_allocates_on_real_tensors(config):
    """Every rank of a 2-rank plan, measured by the dry run on fake tensors (fake process
    group, meta model) and by the same count on real tensors in a real 2-process gloo run.
    The bytes held after the step agree within 1%; the peaks agree exactly under ZeRO-3,
    tensor parallelism and ZeRO-1 in bf16 (both runs FSDP2's ``replicate`` per unit; it had
    been 3.4% short of the real run's DDP with autocast), and fall up to 3.9% short
    elsewhere on these sub-megabyte models: ZeRO-2 with 4 micro-batches 2.6%, the
    pipelines 0.5% (1F1B), 2.4-3.9%
    (interleaved), 1.0-1.7% (DualPipeV), which gloo's collectives allocating temporaries
    the fake group does not would explain; not isolated yet. Within 5%: the accuracy the
    dry run is asked for. The fake step had made a tied table two parameters, one per
    module, with two gradients and two optimizer states (``autopar.runtime.init.to_empty_tied``): the
    peaks had differed by up to 3.3% both ways."""
    config = dict(config)
    name = config.pop("model", "gpt")
    plan = make_plan(name, **config)
    real = run(_real, 2, plan, name)
    report = dry_run(lambda: build(name, "meta"), plan, ranks=[0, 1], measure=True)
    assert report.ok, report.problems
    for r in report.ranks:
        peak, held = real[r.rank]
        assert r.measured.peak_bytes == pytest.approx(peak, rel=0.05), (r.rank, r.measured, peak)
        ddp = config.get("dtype", "fp32") == "fp32" and config.get("pp", 1) == 1
        if config.get("zero_stage", 0) < 2 and config.get("dp", 1) > 1 and ddp:
            # the real run's DDP (fp32) keeps its gradient buckets between steps; the fake one
            # runs FSDP2's replicate (DDP needs real tensors), whose gradients zero_grad frees
            assert r.measured.held_bytes < held, (r.rank, r.measured, held)
        else:
            assert r.measured.held_bytes == pytest.approx(held, rel=0.01), (r.rank, r.measured, held)


@pytest.mark.parametrize(
    "config",
    [
        {"dp": 2, "zero_stage": 3, "num_microbatches": 8},
        {"dp": 2, "zero_stage": 1, "num_microbatches": 8, "dtype": "bf16"},
        {"pp": 2, "num_microbatches": 12},
    ],
    ids=["zero3", "zero1-bf16", "pp-1f1b"],
)
def test_a_shortened_step_peaks_as_the_whole_step(config, monkeypatch):
    """The measured dry run runs 3 micro-batches without pipelining and ``pp + 2`` under
    1F1B (``dry_step.measured_microbatches``); the same dry run made to run all 8 or 12
    peaks at the same bytes on every rank, but for the 4-byte loss the schedule keeps of
    each micro-batch it left out. (On real tensors, gloo's asynchronous collectives move
    a ZeRO-3 peak by up to 2% from run to run, so the comparison is on fake ones.)"""
    plan = make_plan("gpt", **config)
    m, shortened = plan.config.num_microbatches, measured_microbatches(plan.config)
    assert shortened < m
    ranks = list(range(plan.config.world_size))
    short = dry_run(lambda: build("gpt", "meta"), plan, ranks=ranks, measure=True)
    monkeypatch.setattr(dry_run_module, "measured_microbatches", lambda c: c.num_microbatches)
    whole = dry_run(lambda: build("gpt", "meta"), plan, ranks=ranks, measure=True)
    assert short.ok and whole.ok, (short.problems, whole.problems)
    for s, w in zip(short.ranks, whole.ranks):
        assert w.measured.peak_bytes - 4 * (m - shortened) <= s.measured.peak_bytes <= w.measured.peak_bytes, (
            s.rank,
            w.measured,
            s.measured,
        )


def _phases(rank, world, plan):
    model = build("gpt")
    numel, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    job = parallelize(model, plan, loss_fn=cross_entropy, measure_memory=False)
    step = measure_step(job, plan, None)
    return step, numel, tensors


def test_the_peak_is_split_by_when_its_bytes_were_allocated():
    """One process, fp32, Adam, real tensors: the peak's parts add up to it; what it held
    from before the step is the parameters and Adam's two moments and step counters (12
    bytes per parameter and 4 per tensor, by hand); the rest was allocated by the forward
    (activations, logits) and the backward (gradients), none by the optimizer step,
    which runs after the peak."""
    from autopar.runtime.metrics import BACKWARD, BEFORE_STEP, FORWARD, OPTIMIZER

    plan = make_plan("gpt")
    assert plan.settings.optimizer.value == "adam"
    ((step, numel, tensors),) = run(_phases, 1, plan)
    phases = step.peak_phase_bytes
    assert sum(phases.values()) == step.peak_bytes
    assert phases[BEFORE_STEP] == 12 * numel + 4 * tensors
    assert phases[FORWARD] > 0 and phases[BACKWARD] > 0 and phases[OPTIMIZER] == 0


def test_a_later_pipeline_rank_alone_runs_its_predecessors_too():
    """Asked for the second pipeline rank only, a measured dry run also runs the first,
    whose stage announces the shape of the second's input (asked alone, it stopped with
    "no stage before stage 1 announced its output"), says so, and measures the second as
    it does when both are asked for. A device smaller than that peak is a problem."""
    plan = make_plan("gpt", pp=2, num_microbatches=4)
    both = dry_run(lambda: build("gpt", "meta"), plan, ranks=[0, 1], measure=True)
    alone = dry_run(lambda: build("gpt", "meta"), plan, ranks=[1], measure=True)
    assert alone.ok, alone.problems
    assert alone.added_ranks == (0,) and "note: rank 0 ran too: a measured pipeline rank" in alone.to_text()
    assert [r.rank for r in alone.ranks] == [0, 1]
    assert alone.ranks[1].measured.peak_bytes == both.ranks[1].measured.peak_bytes
    reserve = max(s.memory.reserve_bytes for s in plan.prediction.stages)
    tiny = dataclasses.replace(
        plan, prediction=dataclasses.replace(plan.prediction, memory_capacity_bytes=reserve + 1024, fits=False)
    )
    small = dry_run(lambda: build("gpt", "meta"), tiny, ranks=[1], measure=True)
    measured = [p for p in small.problems if "'s measured step peaks at" in p]
    assert [p.split("'s measured step peaks at")[0] for p in measured] == ["rank 0", "rank 1"]
    assert all("the plan does not fit as run" in p for p in measured)
    # the prediction said so first: a plan estimated not to fit is a problem however it runs here
    assert [p for p in small.problems if p not in measured] == [
        f"the plan predicts {plan.prediction.memory_bytes_per_device / 2**30:.3f} GiB per device, more than the "
        f"{(reserve + 1024) / 2**30:.3f} GiB each {plan.cluster.device.name} holds: it does not fit; make a plan "
        f"that does with autopar plan (or estimate another configuration)"
    ]
    assert small.ranks[1].over_device and not alone.ranks[1].over_device


def test_inputs_assumed_because_ranks_left_out_their_predecessors_are_a_note_not_a_problem():
    """Interleaved over 2 pipeline ranks, rank 0 runs stages 0 and 2. Asked for alone
    (``--ranks 0``), stage 2's input, stage 1's output that only rank 1 announces, is
    assumed to be stage 0's and not checked: what the user asked for, so the report is
    OK and says what was assumed in a note. Run with rank 1 as well, nothing is assumed
    unchecked, and rank 0 peaks at the same bytes: the assumption held."""
    plan = make_plan("gpt", pp=2, num_microbatches=4, schedule="interleaved-1f1b", virtual_stages=2)
    later = plan.stage_of_rank(0)[1:]
    assert later == (2,)
    alone = dry_run(lambda: build("gpt", "meta"), plan, ranks=[0], measure=True)
    every = dry_run(lambda: build("gpt", "meta"), plan, measure=True)
    assert alone.ok and every.ok, (alone.problems, every.problems)
    assert alone.assumed_inputs == later and every.assumed_inputs == ()
    text = alone.to_text()
    assert text.splitlines()[0].endswith(": OK") and "problem" not in text, text
    assert "note: the inputs of stages [2] were assumed equal to an earlier stage boundary and not checked" in text
    assert "leave --ranks out to check them" in text and "note: the inputs" not in every.to_text()
    assert [r.rank for r in alone.ranks] == [0] and [r.rank for r in every.ranks] == [0, 1]
    assert alone.ranks[0].measured.peak_bytes == every.ranks[0].measured.peak_bytes


def test_each_rank_is_shown_its_own_pipeline_ranks_predicted_peak():
    """Under 1F1B the first pipeline rank holds more micro-batches in flight than the
    last, so the two ranks' predicted peaks differ; each is its pipeline rank's figure in
    the prediction, and the larger is the plan's peak per device."""
    plan = make_plan("gpt", pp=2, num_microbatches=4)
    report = dry_run(lambda: build("gpt", "meta"), plan)
    assert report.ok, report.problems
    peaks = {}
    for r in report.ranks:
        own = [s.memory.total_bytes for s in plan.prediction.stages if s.pipeline_rank == r.coordinate[0]]
        assert r.predicted_peak_bytes == max(own)
        peaks[r.coordinate[0]] = r.predicted_peak_bytes
    assert sorted(peaks) == [0, 1]
    assert peaks[0] > peaks[1]
    assert max(peaks.values()) == plan.prediction.memory_bytes_per_device


@pytest.mark.parametrize("config", [{}, {"dp": 2, "zero_stage": 1, "dtype": "bf16"}], ids=["one-rank", "replicate"])
def test_a_tied_table_stays_one_parameter_on_fake_tensors(config):
    """The tied GPT's embedding and head share one weight: the dry run's fake parameters
    hold it once, as the model and the real run do."""
    plan = make_plan("gpt", **config)
    report = dry_run(lambda: build("gpt", "meta"), plan, ranks=[0], measure=True)
    model = build("gpt")
    assert model.output.weight is model.tok_embeddings.weight
    assert report.ranks[0].param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
