"""A non-finite loss or gradient on one rank skips the step on every rank, and too many
in a row stop the job (autopar.runtime.finite); ranks with different plans or models
fail at start-up instead of hanging (autopar.runtime.agreement)."""

import logging
import math
import time

import pytest
import torch
from parity import (
    LOSSES,
    LR,
    PG_TIMEOUT_S,
    RunResult,
    all_params,
    assert_parity,
    batches,
    build,
    make_plan,
    megatron_styles,
    run,
)
from test_loss_scale import fp16_plan

from autopar.runtime.api import parallelize
from autopar.runtime.errors import NonFiniteError
from autopar.runtime.spmd import SPMDError, SPMDSettings, run_spmd

pytestmark = pytest.mark.multiprocess
STEPS = 4
MOMENTUM = 0.9  # a skipped step must leave the momentum buffers alone too


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _poisoned(bad_rank: int, bad_steps: set[int], rank: int, clock: list[int]):
    """The gpt loss, NaN on ``bad_rank`` at ``bad_steps`` (counted by ``clock[0]``)."""

    def loss(output, target):
        value = LOSSES["gpt"](output, target)
        return value * float("nan") if rank == bad_rank and clock[0] in bad_steps else value

    return loss


def _train_poisoned(rank, world, plan, bad_rank, bad_steps, max_skips=10):
    records = _Records()
    logging.getLogger("autopar.runtime.finite").addHandler(records)
    clock = [0]
    job = parallelize(
        build("gpt"),
        plan,
        loss_fn=_poisoned(bad_rank, bad_steps, rank, clock),
        measure_memory=False,
        max_consecutive_skips=max_skips,
    )
    opt = job.optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    losses, norms, error = [], [], None
    for step, batch in enumerate(job.shard(batches("gpt", STEPS, plan.config.global_batch_size))):
        clock[0] = step
        losses.append(job.step(batch))
        norms.append(job.clip_grad_norm_(1e9))
        try:
            opt.step()
        except NonFiniteError as exc:
            error = str(exc)
            break
        opt.zero_grad()
        if step == 0:
            after_step0 = all_params(job)
    metrics = [(m.step, m.skipped, m.skip_reason) for m in job.metrics]
    params = all_params(job)
    extra = {"metrics": metrics, "log": records.messages, "error": error, "scale": job.loss_scale, "step0": after_step0}
    return RunResult(losses=losses, params=params, grad_norms=norms, extra=extra)


def _reference_skipping(plan, skipped: set[int]) -> RunResult:
    """One process, the whole global batch, the optimizer not stepped at ``skipped``."""
    model = build("gpt")
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step, (x, y) in enumerate(batches("gpt", STEPS, plan.config.global_batch_size)):
        loss = LOSSES["gpt"](model(x), y)
        loss.backward()
        if step not in skipped:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return RunResult(
        losses=losses, params={n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    )


@pytest.mark.parametrize(
    "config",
    [
        {"dp": 2, "zero_stage": 0},
        {"dp": 2, "zero_stage": 3},
        {"tp": 2, "styles": megatron_styles("gpt")},
        {"pp": 2, "num_microbatches": 2},
    ],
    ids=["ddp", "zero3", "tp", "pp"],
)
def test_a_nan_loss_on_one_rank_skips_that_step_on_every_rank(config):
    """Rank 1's loss is NaN at step 1 only. Every rank skips step 1 (weights and momentum
    untouched), so the run ends equal to a single-process run that did not step at 1;
    every rank records the skip naming rank 1, rank 0 logs it, and the norm reads NaN."""
    plan = make_plan("gpt", **config)
    results = run(_train_poisoned, 2, plan, 1, {1})
    ref = _reference_skipping(plan, {1})
    for res in results:
        assert [m[:2] for m in res.extra["metrics"]] == [(0, False), (1, True), (2, False), (3, False)]
        assert res.extra["metrics"][1][2] == "non-finite loss (first on rank 1) and gradients (first on rank 0)"
        assert math.isnan(res.grad_norms[1])
        assert res.extra["error"] is None
        assert all(torch.isfinite(p).all() for p in res.params.values())
    assert math.isnan(results[1].losses[1])  # the poisoned rank's (a tensor-parallel peer computes its own)
    assert len(results[0].extra["log"]) == 1 and "step 1 skipped on every rank" in results[0].extra["log"][0]
    assert results[1].extra["log"] == []
    clean = [RunResult(losses=r.losses[:1] + r.losses[2:], params=r.params) for r in results]
    assert_parity(clean, RunResult(losses=ref.losses[:1] + ref.losses[2:], params=ref.params))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_nan_loss_in_low_precision_is_skipped_without_touching_the_weights(dtype):
    """bf16 and fp16 (where the loss scaler shares the verdict): rank 0's loss is NaN
    from step 1 on; every weight stays bit-for-bit as the clean first step left it,
    while an unpoisoned run goes on moving them."""
    plan = fp16_plan(dp=2) if dtype == "fp16" else make_plan("gpt", dp=2, dtype="bf16")
    skipped = run(_train_poisoned, 2, plan, 0, {1, 2, 3})
    clean = run(_train_poisoned, 2, plan, 0, set())
    for res in skipped:
        assert [m[1] for m in res.extra["metrics"]] == [False, True, True, True]
        for n, value in res.params.items():
            assert torch.equal(value, res.extra["step0"][n]), n
            assert torch.isfinite(value).all(), n
    assert any(not torch.equal(v, skipped[0].params[n]) for n, v in clean[0].params.items())
    if dtype == "fp16":  # three overflows: the scale halves three times
        assert skipped[0].extra["scale"] == 2.0**13 and clean[0].extra["scale"] == 2.0**16


@pytest.mark.parametrize("plan_fn", [lambda: make_plan("gpt", dp=2), lambda: fp16_plan(dp=2)], ids=["fp32", "fp16"])
def test_too_many_skips_in_a_row_stop_every_rank_naming_the_steps(plan_fn):
    """NaN on rank 1 from step 1 on, at most 2 skips in a row: steps 1 and 2 are skipped
    and step 3 raises on every rank, naming steps 1-3 and rank 1; weights stay finite."""
    results = run(_train_poisoned, 2, plan_fn(), 1, {1, 2, 3}, 2)
    for res in results:
        assert [m[1] for m in res.extra["metrics"]] == [False, True, True, True]
        error = res.extra["error"]
        assert error is not None and error.startswith("steps 1-3: 3 steps in a row had non-finite loss"), error
        assert "loss (first on rank 1)" in error and "max_consecutive_skips=2" in error
        assert all(torch.isfinite(p).all() for p in res.params.values())


def _start(rank, world, plans, models):
    return parallelize(build(models[rank]), plans[rank], loss_fn=LOSSES["gpt"], measure_memory=False)


@pytest.mark.parametrize(
    "other,named",
    [
        ({"tp": 2, "styles": megatron_styles("gpt")}, "plan dp=1 tp=2 pp=1"),
        ({"dp": 2, "zero_stage": 1}, "plan dp=2 tp=1 pp=1 mbs=2 m=2 no-pp zero=1"),
    ],
    ids=["dp2-vs-tp2", "zero0-vs-zero1"],
)
def test_ranks_with_different_plans_fail_at_start_naming_the_rank(other, named):
    """Rank 1 was given another plan of the same world size: both ranks raise within
    seconds (not the process-group timeout), naming rank 1 and both plans."""
    plans = [make_plan("gpt", dp=2), make_plan("gpt", **other)]
    start = time.monotonic()
    with pytest.raises(SPMDError) as info:
        run(_start, 2, plans, ["gpt", "gpt"])
    text = str(info.value)
    assert "the ranks do not run the same plan and model: rank 0 runs dp=2 tp=1 pp=1" in text
    assert f"rank 1: {named}" in text
    assert time.monotonic() - start < PG_TIMEOUT_S  # a hang would wait out the process group's timeout


def test_a_rank_given_another_model_fails_at_start():
    plans = [make_plan("gpt", dp=2)] * 2
    with pytest.raises(SPMDError) as info:
        run(_start, 2, plans, ["gpt", "llama"])
    assert "rank 1: model " in str(info.value)


def _only_rank0_starts(rank, world, plan):
    if rank == 0:
        parallelize(build("gpt"), plan, loss_fn=LOSSES["gpt"], measure_memory=False)


def test_a_rank_that_never_arrives_is_named_after_the_timeout():
    """Rank 1 never calls parallelize: rank 0 gives up after the process group's timeout
    (5 s here) with a PlanMismatchError, instead of hanging in its first collective."""
    settings = SPMDSettings(timeout_s=60, pg_timeout_s=5)
    with pytest.raises(SPMDError) as info:
        run_spmd(_only_rank0_starts, 2, make_plan("gpt", dp=2), settings=settings)
    assert "some rank did not reach autopar.parallelize within 5 s" in str(info.value)
