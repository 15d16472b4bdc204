"""Compiled blocks (``ParallelConfig.compile``): a plan with ``compile=True`` trains like
the eager single-process run, alone and under FSDP2, tensor and pipeline parallelism;
dynamo compiles the blocks (one graph shared by all of them) and nothing else; a
compiler failure reaches the user as one typed line naming the block.

Inductor compiles for the CPU here (it needs a C++ compiler); a cold compile of the
block's graph takes about a minute on two cores, later runs hit inductor's on-disk cache.
Tolerances are parity.py's: inductor's fused kernels sum in another order than eager
ops, which moves values by a few ulps, as a parallel run's reordered sums do.
"""

import pytest
import torch
from parity import GPT_CFG, assert_parity, build, make_plan, megatron_styles, reference, run, token_loss, train
from torch._dynamo.utils import counters

from autopar.runtime.compile import block_units, compile_blocks
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
        dict(dp=2, zero_stage=3),
        dict(tp=2, styles=megatron_styles("gpt")),
        dict(pp=2),
    ],
    ids=["fsdp-zero3", "tp2", "pp2"],
)
def test_compiled_blocks_under_parallelism_train_like_one_process(config):
    """Two gloo ranks: FSDP2 gathering each compiled block's parameters around it, the
    Megatron layout's DTensors inside the compiled graph, or two pipeline stages each
    compiling its own blocks."""
    plan = make_plan("gpt", compile=True, **config)
    results = run(_train_counting, 2, "gpt", plan, STEPS, timeout_s=COMPILE_TIMEOUT_S)
    assert_parity([r for r, _ in results], reference("gpt", plan, STEPS))
    assert all(stats.get("unique_graphs", 0) >= 1 for _, stats in results), results


def _failing_backend(gm, example_inputs):
    raise RuntimeError("no C++ compiler found")


def test_a_block_that_fails_to_compile_is_named_in_one_line(dynamo_reset):
    """A backend that fails (as inductor does without a C++ compiler): the first call
    raises CompileError naming the first block and the way back to eager, with the
    compiler's exception chained."""
    model = build("gpt")
    units = ["tok_embeddings", "pos_embeddings"] + [f"layers.{i}" for i in range(GPT_CFG.n_layers)] + ["norm", "output"]
    assert compile_blocks(model, units, backend=_failing_backend) == [f"layers.{i}" for i in range(GPT_CFG.n_layers)]
    with pytest.raises(CompileError) as info:
        model(torch.zeros(1, GPT_CFG.seq_len, dtype=torch.long))
    message = str(info.value)
    assert "\n" not in message
    assert "block 'layers.0' failed to compile" in message
    assert "no C++ compiler found" in message
    assert "plan with --set compile=false (compile=False) to run eager" in message
    assert isinstance(info.value.__cause__, torch._dynamo.exc.BackendCompilerFailed)


def test_an_error_of_the_blocks_own_code_passes_through(dynamo_reset):
    """A shape error inside a block is the model's, not the compiler's: it is not
    reported as a compile failure (eager would raise it too)."""
    model = build("gpt")
    compile_blocks(model, ["layers.0"], backend="eager")
    wrong = torch.zeros(1, GPT_CFG.seq_len, GPT_CFG.dim + 1)
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError):
        model.layers["0"](wrong)


def test_the_compiled_unit_is_the_checkpoint_wrapped_block(dynamo_reset):
    """With full recomputation the unit the stage holds is the checkpoint wrapper, and
    it is what is compiled: the recomputed forward runs compiled too, and gradients
    equal the eager model's."""
    eager, compiled = build("gpt"), build("gpt")
    plan = make_plan("gpt", compile=True, recompute={f"layers.{i}": "full" for i in range(GPT_CFG.n_layers)})
    apply_recompute(compiled, list(plan.model.units), plan)
    assert compile_blocks(compiled, list(plan.model.units), backend="aot_eager") == [
        f"layers.{i}" for i in range(GPT_CFG.n_layers)
    ]
    assert type(compiled.get_submodule("layers.0")).__name__ == "CheckpointWrapper"
    x = torch.randint(0, GPT_CFG.vocab_size, (2, GPT_CFG.seq_len))
    for m in (eager, compiled):
        token_loss(m(x), x).backward()
    assert counters["stats"]["unique_graphs"] >= 1
    for (n, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
