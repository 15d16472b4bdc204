"""fp16 plans: dynamic loss scaling agreed over every rank (autopar.runtime.loss_scale)."""

import dataclasses

import pytest
import torch
from parity import LOSSES, LR, batches, build, make_plan, megatron_styles, reference, run, train
from torch.distributed.tensor import DTensor

import autopar
from autopar.runtime.api import parallelize
from autopar.runtime.loss_scale import LossScaler

pytestmark = pytest.mark.multiprocess

FP16_RTOL = 5e-3
"""fp16 keeps 11 bits of mantissa (relative precision 2^-11 = 4.9e-4 per rounding); a
few steps accumulate several roundings per matmul, so 5e-3 relative: 8x tighter than
bf16's 2e-2, as fp16 has 3 more mantissa bits."""


def fp16_plan(**config):
    """A plan in fp16 for local processes (the local-cpu preset lists only the precisions
    its CPU runs fast, so fp16 is added at the fp32 rate for planning)."""
    world = config.get("dp", 1) * config.get("tp", 1)
    cluster = autopar.preset("local-cpu", devices_per_node=world)
    device = cluster.device
    peaks = {**device.roofline.peak_flops, autopar.DType.FP16: device.roofline.peak_flops[autopar.DType.FP32]}
    roofline = dataclasses.replace(device.roofline, peak_flops=peaks)
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(device, roofline=roofline))
    return make_plan("gpt", dtype="fp16", cluster=cluster, **config)


@pytest.mark.parametrize("zero,tp", [(0, 1), (3, 2)])
def test_fp16_trains_like_fp32_with_unscaled_losses_and_updates(zero, tp):
    """The schedule runs the loss times 2^16, yet the losses job.step returns and the
    parameters after the updates track the fp32 reference within fp16 precision: the
    loss is reported unscaled and the gradients are unscaled before SGD steps (an update
    with scaled gradients would move every parameter 65536x too far)."""
    styles = megatron_styles("gpt") if tp > 1 else None
    plan = fp16_plan(dp=2, tp=tp, zero_stage=zero, styles=styles)
    results = run(train, 2 * tp, "gpt", plan, 3)
    ref = reference("gpt", plan, steps=3)
    start = dict(build("gpt").named_parameters(remove_duplicate=False))
    moved = max(float((p - start[n].detach()).abs().max()) for n, p in ref.params.items())
    for res in results:
        torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref.losses), rtol=FP16_RTOL, atol=0)
        assert res.losses != ref.losses  # fp16 really ran: an fp32 run matches to ~1e-7
        for n, value in res.params.items():
            assert float((value - ref.params[n]).abs().max()) <= FP16_RTOL * moved, n


def _overflow(rank, world, plan, bad_rank):
    model = build("gpt")
    job = parallelize(model, plan, loss_fn=LOSSES["gpt"], measure_memory=False)
    opt = job.optimizer(torch.optim.SGD, lr=LR)
    data = list(job.shard(batches("gpt", 2, plan.config.global_batch_size)))
    out = {"scale0": job.loss_scale}
    job.step(data[0])
    if rank == bad_rank:  # one element of one rank's gradient overflows
        grad = next(p.grad for p in job.parameters() if p.grad is not None)
        (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")
    before = {
        n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in job.named_parameters().items()
    }
    out["norm"] = job.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    out["unchanged"] = all(
        torch.equal((p.to_local() if isinstance(p, DTensor) else p), before[n])
        for n, p in job.named_parameters().items()
    )
    out["scale1"] = job.loss_scale
    job.step(data[1])
    opt.step()
    out["moved"] = not all(
        torch.equal((p.to_local() if isinstance(p, DTensor) else p), before[n])
        for n, p in job.named_parameters().items()
    )
    out["scale2"] = job.loss_scale
    return out


@pytest.mark.parametrize("zero", [0, 3])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(zero):
    """An inf in rank 1's gradient: every rank reports an infinite norm, leaves its
    parameters bit-for-bit untouched and halves the scale; the next clean step updates
    and keeps the scale (growth waits for 2000 clean steps)."""
    plan = fp16_plan(dp=2, zero_stage=zero)
    for out in run(_overflow, 2, plan, 1):
        assert out["scale0"] == 2.0**16
        assert out["norm"] == float("inf") and out["unchanged"]
        assert out["scale1"] == 2.0**15
        assert out["moved"] and out["scale2"] == 2.0**15


def _schedule(rank, world):
    scaler = LossScaler(growth_interval=2)
    verdicts, scales = [], []
    for bad in (False, False, True, False):
        g = torch.full((3,), 2.0**16) if not bad else torch.tensor([1.0, float("nan"), 1.0])
        grads = [g]
        found = bool(scaler.unscale_(grads, torch.device("cpu")))
        scaler.unscale_(grads, torch.device("cpu"))  # a second call (clip, then step) does not divide again
        scaler.update(found_inf=found)
        verdicts.append((not found, float(g[0])))
        scales.append(scaler.scale)
    return verdicts, scales, scaler.state()


def test_the_scale_grows_after_clean_steps_and_backs_off_after_an_overflow():
    """GradScaler's rule on one rank: two clean steps (growth_interval=2) double the
    scale, an overflow halves it and restarts the count; gradients are divided once."""
    ((verdicts, scales, state),) = run(_schedule, 1)
    assert verdicts == [(True, 1.0), (True, 1.0), (False, 1.0 / 2**17), (True, 1.0)]
    assert scales == [2.0**16, 2.0**17, 2.0**16, 2.0**16]
    assert state == {"scale": 2.0**16, "clean_steps": 1}


def _save_and_resume(rank, world, plan, path):
    job = parallelize(build("gpt"), plan, loss_fn=LOSSES["gpt"], measure_memory=False)
    opt = job.optimizer(torch.optim.SGD, lr=LR)
    batch = next(job.shard(batches("gpt", 1, plan.config.global_batch_size)))
    job.step(batch)
    grad = next(p.grad for p in job.parameters() if p.grad is not None)
    (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("nan")
    opt.step()  # skipped: the scale halves
    job.save_checkpoint(path, step=1)
    resumed = parallelize(build("gpt"), plan, loss_fn=LOSSES["gpt"], measure_memory=False)
    resumed.optimizer(torch.optim.SGD, lr=LR)
    fresh = resumed.loss_scale
    resumed.load_checkpoint(path)
    return fresh, resumed.loss_scale


def test_the_loss_scale_survives_a_checkpoint(tmp_path):
    plan = fp16_plan(dp=2, zero_stage=2)
    for fresh, loaded in run(_save_and_resume, 2, plan, str(tmp_path)):
        assert (fresh, loaded) == (2.0**16, 2.0**15)
