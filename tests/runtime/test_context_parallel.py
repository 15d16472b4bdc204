"""Context parallelism (``cp``): each sample's sequence split over the cp ranks in
torch's head-tail order, attention run as a ring over them, gradients averaged over
``dp x cp``. Runs against one process: the same losses, gradient norms and weights."""

import pytest
from parity import assert_parity, make_plan, reference, run, train

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_context_parallel_trains_like_one_process(name):
    """cp=2 alone (2 ranks), SGD with momentum and clipping: learned positions (GPT) and
    rotary angles with grouped-query attention (Llama) of the whole sequence."""
    plan = make_plan(name, cp=2)
    assert plan.config.cp == 2
    results = run(train, 2, name, plan, 5, 0.5, None, None, 0.9)
    assert_parity(results, reference(name, plan, clip=0.5, momentum=0.9))
