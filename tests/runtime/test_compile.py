"""Compiled blocks (``ParallelConfig.compile``): a plan with ``compile=True`` trains like
the eager single-process run, alone and under FSDP2, tensor and pipeline parallelism;
dynamo compiles the blocks (one graph shared by all of them) and nothing else; a
compiler failure reaches the user as one typed line naming the block.

Inductor compiles for the CPU here (it needs a C++ compiler); a cold compile of the
block's graph takes about a minute on two cores, later runs hit inductor's on-disk cache.
Tolerances are parity.py's: inductor's fused kernels sum in another order than eager
ops, which moves values by a few ulps, as a parallel run's reordered sums do.
"""

import dataclasses

import pytest
import torch
from parity import (
    GPT_CFG,
    assert_parity,
    batches,
    build,
    make_plan,
    megatron_styles,
    reference,
    run,
    token_loss,
    train,
)
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._inductor.exc import InductorError

from autopar.runtime.api import parallelize
from autopar.runtime.compile import block_units, compile_blocks, compile_failures
from autopar.runtime.dry_run import dry_run
from autopar.runtime.errors import CompileError
from autopar.runtime.recompute import apply_recompute

STEPS = 3
COMPILE_TIMEOUT_S = 400
"""A cold compile on every rank at once, on two shared cores."""


def _train_counting(rank, world, name, plan, steps):
    """``train`` on one rank, with dynamo's counts of the graphs it compiled."""
    result = train(rank, world, name, plan, steps)
    return result, dict(counters["stats"])


@pytest.fixture
def dynamo_reset():
    """Leave no compiled code or counters behind in this process."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def test_block_units_are_the_children_of_the_block_container():
    model = build("gpt", "meta")
    units = ["tok_embeddings", "pos_embeddings", "layers.0", "layers.1", "norm", "output"]
    assert block_units(model, units) == ["layers.0", "layers.1"]


@pytest.mark.multiprocess
def test_a_compiled_plan_trains_like_one_eager_process():
    """One rank, two micro-batches: the same losses and weights as the eager reference
    after three SGD steps, and dynamo compiled one graph, which every block ran (the
    embeddings and the head, traced, would be graphs of their own)."""
    plan = make_plan("gpt", compile=True)
    assert plan.config.compile
    ((result, stats),) = run(_train_counting, 1, "gpt", plan, STEPS, timeout_s=COMPILE_TIMEOUT_S)
    assert_parity([result], reference("gpt", plan, STEPS))
    assert stats["unique_graphs"] == 1, stats
    assert stats["calls_captured"] > 0, stats


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "config",
    [
        dict(dp=2, zero_stage=0),
        dict(dp=2, zero_stage=3),
        dict(tp=2, styles=megatron_styles("gpt")),
        dict(pp=2),
    ],
    ids=["ddp", "fsdp-zero3", "tp2", "pp2"],
)
def test_compiled_blocks_under_parallelism_train_like_one_process(config):
    """Two gloo ranks: DDP reducing the gradients compiled backwards produce, FSDP2
    gathering each compiled block's parameters around it, the Megatron layout's DTensors
    inside the compiled graph, or two pipeline stages each compiling its own blocks."""
    plan = make_plan("gpt", compile=True, **config)
    results = run(_train_counting, 2, "gpt", plan, STEPS, timeout_s=COMPILE_TIMEOUT_S)
    assert_parity([r for r, _ in results], reference("gpt", plan, STEPS))
    assert all(stats.get("unique_graphs", 0) >= 1 for _, stats in results), results


def _failing_compiler(gm, example_inputs):
    """What inductor's ``compile_fx_inner`` raises when its C++ compiler fails."""
    raise InductorError(RuntimeError("no C++ compiler found"), None)


def _first_step_error(rank, world, plan, where):
    """The error of a job's first step when compiling the blocks' ``forward`` or
    ``backward`` graph fails as inductor's does without a C++ compiler (AOTAutograd
    compiles the backward at the first backward): ``torch.compile`` is replaced in this
    forked rank, which ends with the run."""
    identity = lambda gm, _: gm  # noqa: E731
    failing = aot_autograd(
        fw_compiler=_failing_compiler if where == "forward" else identity, bw_compiler=_failing_compiler
    )
    real = torch.compile
    torch.compile = lambda fn, backend=None: real(fn, backend=failing)
    job = parallelize(build("gpt"), plan, loss_fn=token_loss, measure_memory=False)
    job.optimizer(torch.optim.SGD, lr=0.1)
    try:
        job.step(next(iter(job.shard(batches("gpt", 1, plan.config.global_batch_size)))))
    except Exception as exc:
        return type(exc).__name__, str(exc), type(exc.__cause__).__name__
    return None


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("where", "named"),
    [("forward", "block 'layers.0' failed"), ("backward", "the backward of compiled blocks 'layers.0' to 'layers.3'")],
)
def test_a_failed_compilation_stops_the_first_step_with_one_line(where, named):
    """The forward's failure names the block that failed (under the RuntimeError a
    pipeline stage wraps it in), the backward's (compiled at the first backward) the
    rank's compiled blocks; both say the compiler's message and the way back to eager,
    with the compiler's exception chained."""
    plan = make_plan("gpt", compile=True)
    ((kind, message, cause),) = run(_first_step_error, 1, plan, where)
    assert kind == "CompileError"
    assert "\n" not in message
    assert named in message
    assert "(RuntimeError: no C++ compiler found)" in message
    assert message.endswith("plan with --set compile=false (compile=False) to run eager.")
    assert cause == "InductorError"


def test_a_named_failure_leaves_the_pipeline_stages_wrapper_and_others_pass():
    """A pipeline stage wraps a failing forward in a RuntimeError (a block recompiled in
    a micro-batch's forward fails there): the block's CompileError comes out as it was.
    A failure that is not the compiler's passes through unchanged, as does everything
    when the rank compiled no block."""
    named = CompileError("block 'layers.1' failed to compile")
    with pytest.raises(CompileError) as info, compile_failures(["layers.0", "layers.1"]):
        raise RuntimeError("[Stage 0] failed to run forward") from named
    assert info.value is named
    with pytest.raises(ValueError), compile_failures(["layers.0"]):
        raise ValueError("a bad batch")
    with pytest.raises(InductorError), compile_failures([]):
        raise InductorError(RuntimeError("no C++ compiler found"), None)


def test_an_error_of_the_blocks_own_code_passes_through(dynamo_reset):
    """A shape error inside a block is the model's, not the compiler's: it is not
    reported as a compile failure (eager would raise it too)."""
    model = build("gpt")
    compile_blocks(model, ["layers.0"], backend="eager")
    wrong = torch.zeros(1, GPT_CFG.seq_len, GPT_CFG.dim + 1)
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError):
        model.layers["0"](wrong)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputing_blocks_are_compiled_with_their_recomputation(mode, dynamo_reset):
    """Full recomputation: the unit the stage holds is the checkpoint wrapper, and it is
    what is compiled, so the recomputed forward is traced too; selective: the block's
    forward that checkpoints its attention core. Dynamo traces one graph for the blocks
    and the gradients equal the eager model's (AOTAutograd with eager kernels: the same
    ops, in the same order)."""
    eager, compiled = build("gpt"), build("gpt")
    plan = make_plan("gpt", compile=True, recompute={f"layers.{i}": mode for i in range(GPT_CFG.n_layers)})
    apply_recompute(compiled, list(plan.model.units), plan)
    blocks = [f"layers.{i}" for i in range(GPT_CFG.n_layers)]
    assert compile_blocks(compiled, list(plan.model.units), backend="aot_eager") == blocks
    wrapper = type(compiled.get_submodule("layers.0")).__name__
    assert wrapper == ("CheckpointWrapper" if mode == "full" else "Block")
    x = torch.randint(0, GPT_CFG.vocab_size, (2, GPT_CFG.seq_len))
    for m in (eager, compiled):
        token_loss(m(x), x).backward()
    assert counters["stats"]["unique_graphs"] >= 1
    for (n, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.multiprocess
def test_a_measured_dry_run_runs_the_blocks_eager_and_says_so():
    """Fake tensors cannot be compiled: the dry run of a compiled plan measures the
    eager step, byte for byte the eager plan's, and its report notes it with the plan's
    peak priced eager (the contrast the plan carries: the eager plan's own peak)."""
    compiled = make_plan("gpt", dp=2, zero_stage=3, compile=True)
    eager = make_plan("gpt", dp=2, zero_stage=3)
    reports = [dry_run(lambda: build("gpt", "meta"), p, ranks=[0, 1], measure=True) for p in (compiled, eager)]
    assert all(r.ok for r in reports), [r.problems for r in reports]
    assert [r.eager_blocks for r in reports] == [True, False]
    assert "dry run runs them eager" in reports[0].to_text()
    assert reports[0].eager_peak_bytes == eager.prediction.memory_bytes_per_device
    assert f"priced eager, the plan's peak is {eager.prediction.memory_bytes_per_device / 2**30:.3f} GiB" in (
        reports[0].to_text()
    )
    assert "eager" not in reports[1].to_text() and reports[1].eager_peak_bytes is None
    peaks = [[(r.measured.peak_bytes, r.measured.held_bytes) for r in report.ranks] for report in reports]
    assert peaks[0] == peaks[1]


@pytest.mark.multiprocess
def test_an_eager_step_over_the_device_is_a_note_for_a_compiled_plan():
    """On a device just above the reserve, the measured eager step overflows: a problem for
    the eager plan ("does not fit as run"), but for the compiled one, whose own step keeps
    less and cannot be measured here, a note naming the ranks (the report stays OK)."""
    reports = []
    for compiled in (True, False):
        plan = make_plan("gpt", dp=2, zero_stage=3, compile=compiled)
        reserve = max(s.memory.reserve_bytes for s in plan.prediction.stages)
        small = dataclasses.replace(
            plan, prediction=dataclasses.replace(plan.prediction, memory_capacity_bytes=reserve + 1024)
        )
        reports.append(dry_run(lambda: build("gpt", "meta"), small, ranks=[0, 1], measure=True))
    compiled_report, eager_report = reports
    assert compiled_report.ok and compiled_report.eager_over_device == (0, 1)
    assert "note: the eager step of ranks 0, 1 exceeds the device" in compiled_report.to_text()
    assert [p.split("'s measured")[0] for p in eager_report.problems] == ["rank 0", "rank 1"]
    assert all(p.endswith("the plan does not fit as run") for p in eager_report.problems)
    assert eager_report.eager_over_device == ()


@pytest.mark.multiprocess
def test_an_eager_step_far_past_the_plans_own_price_is_a_problem_for_a_compiled_plan():
    """A compiled plan whose file was edited to 16 samples per micro-batch (the batch
    arithmetic kept, the prediction left as it was): its measured eager step (3 MiB) is
    about three times the plan's own eager peak (1 MiB) and overflows a 2 MiB device. It
    said OK with a note, as for a compiled step that keeps less than its eager twin; it
    is a problem now. The plan as made, on the same device, stays OK."""
    plan = make_plan("gpt", dp=1, micro_batch_size=1, num_microbatches=16, compile=True)
    reserve = max(s.memory.reserve_bytes for s in plan.prediction.stages)
    device = dataclasses.replace(plan.prediction, memory_capacity_bytes=reserve + 2 * 2**20)
    made = dataclasses.replace(plan, prediction=device)
    edited = dataclasses.replace(made, config=dataclasses.replace(plan.config, micro_batch_size=16, num_microbatches=1))
    reports = [dry_run(lambda: build("gpt", "meta"), p, ranks=[0], measure=True) for p in (made, edited)]
    assert reports[0].ok, reports[0].problems
    (problem,) = reports[1].problems
    assert problem.startswith("rank 0's measured step peaks at") and "a hand-edited plan?" in problem
    assert reports[1].ranks[0].measured.peak_bytes > 2.5 * plan.prediction.memory_bytes_per_device
