"""Cost-model terms of what GPU kernels hide and CPU processes pay (the CPU-host
effects): framework time per op, per sharded leaf and per FSDP2 collective, weight
traffic, waits for the slowest rank, FSDP2's copies, unhidden CPU communication."""

import math

import pytest

from autopar.cost.comm import all_reduce_s, group_span
from autopar.cost.compute import ComputeRates, rates
from autopar.cost.leaf import TPContext
from autopar.graph import extract
from autopar.hardware import HostEffects, preset
from autopar.hardware.device import with_host
from autopar.models import build_named_model
from autopar.vocab import DType, Layout, TPStyle


def test_framework_overhead_is_charged_per_op_and_per_sharded_leaf():
    graph = extract(build_named_model("gpt2-small"), seq_len=128, dtype="fp32")
    block = graph.profile_of(1)
    assert all(leaf.fwd_ops > 0 for leaf in block.leaves)
    assert sum(f.glue_ops + f.attn_ops for f in block.flows) > 0
    cpu = preset("local-cpu", devices_per_node=2)
    base = TPContext(
        tp=2,
        span=group_span(2, 1, 2),
        cluster=cpu,
        rates=rates(cpu.device, DType.FP32),
        micro_batch=1,
        tokens=128,
        boundary=Layout.R,
        first=False,
        last=False,
        loss_parallel=False,
        sequence_parallel=False,
    )
    slow = TPContext(**{**base.__dict__, "host": HostEffects(op_overhead_s=1e-3, tp_overhead_s=5e-3)})
    from autopar.cost.leaf import leaf_fwd_s

    leaf = next(x for x in block.leaves if x.name == "attn.c_attn" or x.name.endswith("wq"))
    assert leaf_fwd_s(leaf, TPStyle.REPLICATE, slow) - leaf_fwd_s(leaf, TPStyle.REPLICATE, base) == pytest.approx(
        1e-3 * leaf.fwd_ops
    )
    assert leaf_fwd_s(leaf, TPStyle.COLUMN, slow) - leaf_fwd_s(leaf, TPStyle.COLUMN, base) == pytest.approx(
        1e-3 * leaf.fwd_ops + 5e-3
    )


def test_weight_traffic_is_per_call_and_sharded_by_tensor_parallelism():
    """A memory-bound leaf: doubling the micro-batch adds only its activation bytes; a
    column split divides its weight traffic by tp, a sequence-split norm does not."""
    from autopar.cost.leaf import leaf_fwd_s

    graph = extract(build_named_model("gpt2-small"), seq_len=8, dtype="fp32")
    block = graph.profile_of(1)
    slow_flops = preset("local-cpu", devices_per_node=2)
    r = ComputeRates(matmul_flops_per_s=1e30, vector_flops_per_s=1e30, bytes_per_s=1e9)
    ctx = TPContext(
        tp=2,
        span=group_span(2, 1, 2),
        cluster=slow_flops,
        rates=r,
        micro_batch=1,
        tokens=8,
        boundary=Layout.R,
        first=False,
        last=False,
        loss_parallel=False,
        sequence_parallel=True,
    )
    twice = TPContext(**{**ctx.__dict__, "micro_batch": 2})
    fc = next(x for x in block.leaves if x.name.endswith("c_fc") or x.name.endswith("w1"))
    assert fc.weight_bytes == pytest.approx(4 * fc.param_numel)
    assert leaf_fwd_s(fc, TPStyle.REPLICATE, ctx) == pytest.approx((fc.fwd_bytes + fc.weight_bytes) / 1e9)
    assert leaf_fwd_s(fc, TPStyle.REPLICATE, twice) - leaf_fwd_s(fc, TPStyle.REPLICATE, ctx) == pytest.approx(
        fc.fwd_bytes / 1e9
    )
    assert leaf_fwd_s(fc, TPStyle.COLUMN, ctx) == pytest.approx((fc.fwd_bytes + fc.weight_bytes) / 2 / 1e9)
    norm = next(x for x in block.leaves if x.kind.value == "norm")
    assert leaf_fwd_s(norm, TPStyle.SEQUENCE, ctx) == pytest.approx((norm.fwd_bytes / 2 + norm.weight_bytes) / 1e9)


def test_exposed_weight_traffic_is_added_to_the_roofline_and_accumulated_per_micro_batch():
    """CPU processes: a compute-bound GEMM pays its weight pass on top of its arithmetic
    (the roofline alone would hide it), and every micro-batch adds the weight gradient
    into ``.grad``: read both, write one, 12 bytes per fp32 parameter; a column split
    shards both."""
    from autopar.cost.leaf import leaf_accumulate_s, leaf_fwd_s, leaf_param_numel

    graph = extract(build_named_model("gpt2-small"), seq_len=8, dtype="fp32")
    fc = next(x for x in graph.profile_of(1).leaves if x.name.endswith("c_fc") or x.name.endswith("w1"))
    cpu = preset("local-cpu", devices_per_node=2)
    assert cpu.device.host.exposed_weight_traffic
    r = ComputeRates(matmul_flops_per_s=1e9, vector_flops_per_s=1e9, bytes_per_s=1e10)
    roofline = TPContext(
        tp=2,
        span=group_span(2, 1, 2),
        cluster=cpu,
        rates=r,
        micro_batch=4,
        tokens=8,
        boundary=Layout.R,
        first=False,
        last=False,
        loss_parallel=False,
        sequence_parallel=False,
    )
    exposed = TPContext(**{**roofline.__dict__, "host": HostEffects(exposed_weight_traffic=True)})
    compute = 4 * fc.matmul_flops / 1e9 + 4 * (fc.fwd_flops - fc.matmul_flops) / 1e9
    assert compute > (4 * fc.fwd_bytes + fc.weight_bytes) / 1e10  # compute-bound: the roofline hides the bytes
    assert leaf_fwd_s(fc, TPStyle.REPLICATE, roofline) == pytest.approx(compute)
    assert leaf_fwd_s(fc, TPStyle.REPLICATE, exposed) == pytest.approx(compute + fc.weight_bytes / 1e10)
    assert leaf_accumulate_s(fc, TPStyle.REPLICATE, roofline) == 0.0
    assert leaf_accumulate_s(fc, TPStyle.REPLICATE, exposed) == pytest.approx(12 * fc.param_numel / 1e10)
    shard = leaf_param_numel(fc, TPStyle.COLUMN, 2)
    assert shard < 0.6 * fc.param_numel
    assert leaf_accumulate_s(fc, TPStyle.COLUMN, exposed) == pytest.approx(12 * shard / 1e10)


def test_fsdp_framework_time_is_charged_per_collective_call():
    """ZeRO-3 without a pipeline issues, per unit and micro-batch, a forward gather, a
    backward gather and a reduce-scatter; ZeRO-2 one reduce-scatter per micro-batch and
    one gather per step. Each call pays ``fsdp_overhead_s``."""
    import dataclasses

    import autopar

    model = build_named_model("gpt2-small")
    cpu = preset("local-cpu", devices_per_node=2)
    slow = dataclasses.replace(cpu, device=with_host(cpu.device, fsdp_overhead_s=1e-3))
    for zero, calls_per_unit in ((3, lambda m: 3 * m), (2, lambda m: m + 1)):
        cfg = {"dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 1, "num_microbatches": 3, "zero_stage": zero}
        base = autopar.estimate(model, cpu, cfg, global_batch_size=6, seq_len=64)
        charged = autopar.estimate(model, slow, cfg, global_batch_size=6, seq_len=64)
        units = len(extract(model, seq_len=64, dtype="fp32").units)  # what FSDP2 wraps: blocks, prologue, epilogue
        assert units == 14
        assert charged.prediction.breakdown.dp_comm_s - base.prediction.breakdown.dp_comm_s == pytest.approx(
            calls_per_unit(3) * units * 1e-3
        )


def test_fsdp_framework_time_grows_with_the_parameter_tensors_of_each_unit():
    """Each call also pays ``fsdp_tensor_overhead_s`` per parameter tensor of its unit:
    over a step, calls per unit x every parameter tensor of the model (a tied weight
    once for each module that holds it)."""
    import dataclasses

    import autopar

    model = build_named_model("gpt2-small")
    tensors = sum(1 for _ in model.named_parameters(remove_duplicate=False))
    cpu = preset("local-cpu", devices_per_node=2)
    slow = dataclasses.replace(cpu, device=with_host(cpu.device, fsdp_tensor_overhead_s=1e-4))
    assert sum(extract(model, seq_len=64, dtype="fp32").profile_of(u).param_tensors for u in range(14)) == tensors
    for zero, calls_per_unit in ((3, lambda m: 3 * m), (2, lambda m: m + 1)):
        cfg = {"dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 1, "num_microbatches": 3, "zero_stage": zero}
        base = autopar.estimate(model, cpu, cfg, global_batch_size=6, seq_len=64)
        charged = autopar.estimate(model, slow, cfg, global_batch_size=6, seq_len=64)
        assert charged.prediction.breakdown.dp_comm_s - base.prediction.breakdown.dp_comm_s == pytest.approx(
            calls_per_unit(3) * tensors * 1e-4
        )


def test_the_expected_maximum_of_normals_and_the_wait_at_blocking_collectives():
    """Closed forms: the maximum of two standard normals averages 1/sqrt(pi), of three
    3/(2 sqrt(pi)) (David & Nagaraja, Order Statistics); one rank waits for nobody. k
    meetings splitting W seconds of work cost e_n sigma sqrt(k W)."""
    from autopar.cost.host import expected_max_normal, sync_wait_s

    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-9)
    assert expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-9)
    assert expected_max_normal(2) < expected_max_normal(4) < expected_max_normal(8)
    with pytest.raises(ValueError, match="rank count >= 1, got 0"):
        expected_max_normal(0)
    # 16 meetings over 0.25 s of work: 16 segments of 15.6 ms, each costing e_2 sigma sqrt(15.6 ms)
    assert sync_wait_s(0.01, 2, 16, 0.25) == pytest.approx(16 * 0.01 / math.sqrt(math.pi) * math.sqrt(0.25 / 16))
    assert sync_wait_s(0.01, 1, 16, 0.25) == 0.0 and sync_wait_s(0.0, 2, 16, 0.25) == 0.0
    assert sync_wait_s(0.01, 2, 0, 0.25) == 0.0


def test_tensor_parallel_ranks_wait_for_the_slowest_at_every_blocking_collective():
    """gpt2-small at tp=2 on CPU processes whose ranks finish work sigma sqrt(T) apart:
    the step grows by m e_2 sigma sqrt(k W) with W the compute per micro-batch and k its
    blocking collectives, at least the four of each of the 12 Megatron blocks (plus the
    vocabulary-parallel embedding's and loss's, at most 8 more); the whole increase is
    tensor-parallel communication; twice the noise waits twice as long; a plan without
    tensor parallelism waits once a step, at DDP's gradient reduction."""
    import dataclasses

    import autopar

    model = build_named_model("gpt2-small")
    cpu = preset("local-cpu", devices_per_node=2)

    def with_noise(sigma):
        return dataclasses.replace(cpu, device=with_host(cpu.device, sync_noise_s_per_sqrt_s=sigma))

    m = 3
    cfg = {"dp": 1, "tp": 2, "pp": 1, "micro_batch_size": 1, "num_microbatches": m}
    base, once, twice = (
        autopar.estimate(model, cl, cfg, global_batch_size=m, seq_len=128).prediction
        for cl in (with_noise(0.0), with_noise(0.01), with_noise(0.02))
    )
    wait = once.step_time_s - base.step_time_s
    assert once.breakdown.tp_comm_s - base.breakdown.tp_comm_s == pytest.approx(wait, rel=1e-9)
    assert twice.step_time_s - base.step_time_s == pytest.approx(2 * wait, rel=1e-9)
    work = base.breakdown.compute_s / m
    meetings = (wait / (m * 0.01 / math.sqrt(math.pi))) ** 2 / work
    assert meetings == pytest.approx(round(meetings), abs=1e-6)
    assert 4 * 12 <= round(meetings) <= 4 * 12 + 8
    dp = {"dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 1, "num_microbatches": m}
    quiet, noisy = (
        autopar.estimate(model, with_noise(sigma), dp, global_batch_size=2 * m, seq_len=128).prediction
        for sigma in (0.0, 0.01)
    )
    # without tensor parallelism the ranks meet once a step, at DDP's last bucket
    once_a_step = 0.01 / math.sqrt(math.pi) * math.sqrt(quiet.breakdown.compute_s)
    assert noisy.step_time_s - quiet.step_time_s == pytest.approx(once_a_step, rel=1e-9)
    assert noisy.breakdown.dp_comm_s - quiet.breakdown.dp_comm_s == pytest.approx(once_a_step, rel=1e-9)


def test_a_spread_in_the_ranks_speed_waits_in_proportion_to_the_work_between_meetings():
    """With ``delta`` the ranks drift ``delta x T`` apart over T seconds of work beyond the
    random walk: k meetings over W cost e_n sqrt(k sigma^2 W + delta^2 W^2). With no
    random walk that is e_n delta W however many meetings split the work: a rank that
    runs slower loses its share at every meeting. DDP's one meeting per step and tensor
    parallelism's 48-56 per micro-batch both wait e_2 delta W, W the step's compute."""
    import dataclasses

    import autopar
    from autopar.cost.host import sync_wait_s

    e2 = 1 / math.sqrt(math.pi)
    assert sync_wait_s(0.0, 2, 1, 0.4, speed_spread=0.08) == pytest.approx(e2 * 0.08 * 0.4, rel=1e-9)
    assert sync_wait_s(0.01, 2, 4, 0.4, speed_spread=0.08) == pytest.approx(
        e2 * math.sqrt(4 * 0.01**2 * 0.4 + (0.08 * 0.4) ** 2), rel=1e-9
    )
    assert sync_wait_s(0.01, 1, 4, 0.4, speed_spread=0.08) == 0.0
    model = build_named_model("gpt2-small")
    cpu = preset("local-cpu", devices_per_node=2)

    def with_spread(delta):
        return dataclasses.replace(
            cpu, device=with_host(cpu.device, sync_noise_s_per_sqrt_s=0.0, sync_speed_spread=delta)
        )

    m = 3
    dp = {"dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 1, "num_microbatches": m}
    quiet, spread = (
        autopar.estimate(model, with_spread(d), dp, global_batch_size=2 * m, seq_len=128).prediction
        for d in (0.0, 0.08)
    )
    assert spread.step_time_s - quiet.step_time_s == pytest.approx(e2 * 0.08 * quiet.breakdown.compute_s, rel=1e-9)
    tp = {"dp": 1, "tp": 2, "pp": 1, "micro_batch_size": 1, "num_microbatches": m}
    tp_quiet, tp_spread = (
        autopar.estimate(model, with_spread(d), tp, global_batch_size=m, seq_len=128).prediction for d in (0.0, 0.08)
    )
    assert tp_spread.step_time_s - tp_quiet.step_time_s == pytest.approx(
        e2 * 0.08 * tp_quiet.breakdown.compute_s, rel=1e-9
    )


def test_fsdp_collectives_that_compute_does_not_hide_wait_for_the_slowest_rank():
    """ZeRO-3 on CPU processes (no overlap): each of the 3 m x 14 FSDP calls of a step is a
    meeting of the dp=2 ranks, so the step grows by e_2 sigma sqrt(3 m 14 W), W the step's
    compute; with communication 80% hidden only a fifth of the calls are meetings."""
    import dataclasses

    import autopar

    model = build_named_model("gpt2-small")
    cpu = preset("local-cpu", devices_per_node=2)
    m = 3
    cfg = {
        "dp": 2,
        "tp": 1,
        "pp": 1,
        "micro_batch_size": 1,
        "num_microbatches": m,
        "zero_stage": 3,
        "recompute": "none",
    }

    def step(sigma, overlap):
        dev = dataclasses.replace(with_host(cpu.device, sync_noise_s_per_sqrt_s=sigma), comm_overlap=overlap)
        return autopar.estimate(
            model, dataclasses.replace(cpu, device=dev), cfg, global_batch_size=2 * m, seq_len=64
        ).prediction

    quiet, noisy = step(0.0, 0.0), step(0.01, 0.0)
    work = quiet.breakdown.compute_s
    wait = 0.01 / math.sqrt(math.pi) * math.sqrt(3 * m * 14 * work)
    assert noisy.breakdown.dp_comm_s - quiet.breakdown.dp_comm_s == pytest.approx(wait, rel=1e-9)
    assert noisy.step_time_s - quiet.step_time_s == pytest.approx(wait, rel=1e-9)
    hidden = step(0.01, 0.8).breakdown.dp_comm_s - step(0.0, 0.8).breakdown.dp_comm_s
    assert hidden == pytest.approx(wait * math.sqrt(0.2), rel=1e-9)


def test_fsdp_copies_around_each_collective_are_priced_by_their_bytes():
    """FSDP2 copies the local shards into the flat buffer and the gathered buffer out into
    the parameters (read and write each): 2 S (1 + 1/dp) bytes per collective of S. A
    ZeRO-3 step of m micro-batches gathers twice and reduce-scatters once per
    micro-batch: with the transfers and framework time the same, the copies add
    3 m x 2 S (1 + 1/dp) / bandwidth, S the stage's fp32 parameter bytes."""
    import dataclasses

    import autopar
    from autopar.cost.host import fsdp_copy_s

    none = HostEffects.none()
    assert fsdp_copy_s(none, 1e9, 4, streaming_bytes_per_s=1e10) == pytest.approx(2 * 1e9 * 1.25 / 1e10)
    assert fsdp_copy_s(none, 1e9, 1, streaming_bytes_per_s=1e10) == 0.0
    measured = HostEffects(fsdp_copy_bytes_per_s=2.5e9)  # a measured rate replaces the streaming one
    assert fsdp_copy_s(measured, 1e9, 4, streaming_bytes_per_s=1e10) == pytest.approx(2 * 1e9 * 1.25 / 2.5e9)
    model = build_named_model("gpt2-small")
    cpu = preset("local-cpu", devices_per_node=2)
    # no sync noise: the waits depend on the compute, which the bandwidth moves too
    cpu = dataclasses.replace(cpu, device=with_host(cpu.device, sync_noise_s_per_sqrt_s=0.0))
    m = 3
    cfg = {"dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 1, "num_microbatches": m, "zero_stage": 3}
    plan = autopar.estimate(model, cpu, cfg, global_batch_size=2 * m, seq_len=64)
    numel = sum(p.numel() for p in model.parameters())  # tied weights counted once
    rate = rates(cpu.device, DType.FP32).bytes_per_s
    faster = dataclasses.replace(
        cpu,
        device=dataclasses.replace(
            cpu.device,
            roofline=dataclasses.replace(
                cpu.device.roofline, memory_bandwidth_bytes_per_s=cpu.device.roofline.memory_bandwidth_bytes_per_s * 2
            ),
        ),
    )
    quick = autopar.estimate(model, faster, cfg, global_batch_size=2 * m, seq_len=64)
    # doubling the bandwidth halves the copies (compute moves too, so compare the comm term)
    copies = 3 * m * 2 * 4.0 * numel * 1.5 / rate
    assert plan.prediction.breakdown.dp_comm_s - quick.prediction.breakdown.dp_comm_s == pytest.approx(
        copies / 2, rel=1e-6
    )
    # a measured copy rate (a network profile's) replaces the streaming bandwidth
    slow = dataclasses.replace(cpu, device=with_host(cpu.device, fsdp_copy_bytes_per_s=rate / 4))
    slowed = autopar.estimate(model, slow, cfg, global_batch_size=2 * m, seq_len=64)
    assert slowed.prediction.breakdown.dp_comm_s - plan.prediction.breakdown.dp_comm_s == pytest.approx(
        3 * copies, rel=1e-6
    )


def test_cpu_communication_is_not_hidden_and_the_optimizer_runs_at_its_measured_rate():
    """local-cpu: gloo shares the cores, so data-parallel all-reduce adds its whole time
    (and the wait for the slower rank); the AdamW step moves 30 bytes per parameter at
    the device's optimizer rate, after the check that the gradients are finite."""
    import dataclasses

    import autopar

    model = build_named_model("gpt2-small")
    cpu = preset("local-cpu", devices_per_node=2)
    cfg = {"dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 1, "zero_stage": 0}
    est = autopar.estimate(model, cpu, cfg, global_batch_size=2, seq_len=64)
    params = est.prediction.breakdown  # one stage: all parameters on each rank
    numel = sum(p.numel() for p in model.parameters())
    span = group_span(2, 1, 2)
    assert cpu.device.comm_overlap == 0.0 and cpu.device.host.sync_speed_spread == 0.0
    # and the wait for the slower rank at DDP's last bucket, once a step (cost.sync)
    wait = cpu.device.host.sync_noise_s_per_sqrt_s / math.sqrt(math.pi) * math.sqrt(params.compute_s)
    assert params.dp_comm_s == pytest.approx(all_reduce_s(4.0 * numel, span, cpu) + wait, rel=1e-6)
    # then every rank reads its gradients once for the finite check, and the world all-reduces 8 bytes
    check = 4.0 * numel / rates(cpu.device, est.config.dtype).bytes_per_s + all_reduce_s(8.0, span, cpu)
    assert params.optimizer_s == pytest.approx(30.0 * numel / cpu.device.host.optimizer_bytes_per_s + check, rel=1e-6)
    overlapping = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, comm_overlap=0.8))
    hidden = autopar.estimate(model, overlapping, cfg, global_batch_size=2, seq_len=64).prediction.breakdown
    assert hidden.dp_comm_s < params.dp_comm_s
