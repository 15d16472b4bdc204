"""The zero-bubble schedules (Qi et al. 2023) against the single-process run: the
backward split into input and weight gradients, the weight gradients deferred, and
``zbv``'s V placement (rank r runs stages r and 2p - 1 - r) give the same losses and
parameters (tolerances in parity.py)."""

import pytest
from parity import assert_parity, build, make_plan, reference, run, train

from autopar.runtime.api import analyse
from autopar.runtime.errors import PipelineError

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("m", [2, 4, 6])
def test_zbv_llama(m):
    """Llama's embedding and head are separate weights; with m=2 < 2p - 1 torch's
    ZB-V drops the missing micro-batches' actions, m=6 runs more than one round."""
    plan = make_plan("llama", pp=2, schedule="zbv", virtual_stages=2, num_microbatches=m)
    assert plan.stage_of_rank(0) == (0, 3) and plan.stage_of_rank(1) == (1, 2)
    assert_parity(run(train, 2, "llama", plan), reference("llama", plan))


@pytest.mark.parametrize("schedule", ["interleaved-zb", "zbv"])
def test_zero_bubble_with_data_parallel(schedule):
    """dp=2 x pp=2: DDP's gradient reduction after the deferred weight gradients."""
    plan = make_plan("llama", dp=2, pp=2, schedule=schedule, virtual_stages=2, num_microbatches=2)
    assert_parity(run(train, 4, "llama", plan, timeout_s=120), reference("llama", plan))


def test_zbv_refuses_tied_weights_on_one_rank():
    """GPT ties its embedding and head; ZB-V puts the first and last stages on rank 0,
    where each stage would scale and update the shared weight once."""
    plan = make_plan("gpt", pp=2, schedule="zbv", virtual_stages=2, num_microbatches=4)
    with pytest.raises(PipelineError, match="tok_embeddings.weight.*rank 0, in stages \\[0, 3\\]"):
        analyse(build("gpt"), plan)
