"""Asynchronous tensor parallelism (``ParallelConfig.async_tp``): refused in one typed line
off CUDA before any collective; on CUDA the tensor-parallel group is registered for
symmetric memory and inductor's micro-pipeline TP pass is on while the job's steps (where
its blocks compile) run, and off again after; a dry run runs the collectives synchronously
and says so.

The fused ops themselves need CUDA devices with symmetric memory: the job's wiring is
checked on CPU with the CUDA gate lifted and symmetric memory left unregistered, where
inductor's pass runs over the compiled graphs and fuses nothing.
"""

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from parity import batches, build, make_plan, megatron_styles, run, token_loss
from torch._inductor import config as inductor_config
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.runtime import async_tp as async_tp_module
from autopar.runtime.api import parallelize
from autopar.runtime.async_tp import check_async_tp, enable_async_tp, micro_pipeline_tp
from autopar.runtime.dry_run import dry_run
from autopar.runtime.errors import AsyncTPError

COMPILE_TIMEOUT_S = 400
"""A cold compile on both ranks at once, on two shared cores (as test_compile.py)."""


def _async_tp_plan(**config) -> autopar.Plan:
    """A tp=2, sequence-parallel (Megatron's layout), compiled gpt plan with ``async_tp``
    set (the planner's estimate does not take the field yet: it is set on the estimated plan)."""
    styles = megatron_styles("gpt", sequence_parallel=True)
    plan = make_plan("gpt", tp=2, sequence_parallel=True, compile=True, styles=styles, **config)
    return dataclasses.replace(plan, config=dataclasses.replace(plan.config, async_tp=True))


def test_the_refusal_off_cuda_is_one_line_naming_the_value():
    with pytest.raises(AsyncTPError, match=r"^async_tp=True needs CUDA devices .*--set async_tp=false") as info:
        check_async_tp(torch.device("cpu"))
    assert "\n" not in str(info.value) and "run on cpu" in str(info.value)
    check_async_tp(torch.device("cuda", 0))  # only the device is checked: no CUDA needed to pass


def _refusal(rank, world, plan):
    """What ``parallelize`` raises on this rank, with the cross-rank steps it started
    before: the plan-agreement exchange (the first, through the store), the mesh's groups
    and ``torch.distributed``'s collectives are counted; there must be none."""
    from autopar.runtime import api

    started = []
    monkeypatch = pytest.MonkeyPatch()
    collectives = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier")
    for module, name in [(api, "check_agreement"), (api, "build_mesh"), *((dist, n) for n in collectives)]:
        original = getattr(module, name)

        def counting(*args, original=original, name=name, **kwargs):
            started.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    try:
        parallelize(build("gpt"), plan, loss_fn=token_loss, measure_memory=False)
    except AsyncTPError as exc:
        return type(exc).__name__, str(exc), tuple(started)
    finally:
        monkeypatch.undo()
    return None


@pytest.mark.multiprocess
def test_every_rank_refuses_on_cpu_before_any_collective():
    plan = _async_tp_plan()
    assert plan.config.async_tp and plan.config.compile and plan.config.sequence_parallel
    for name, message, started in run(_refusal, 2, plan, timeout_s=60):
        assert name == "AsyncTPError" and message.startswith("async_tp=True needs CUDA devices"), message
        assert "\n" not in message
        assert started == ()


def test_enabling_registers_the_tensor_parallel_group_for_symmetric_memory(fake_world, monkeypatch):
    from torch.distributed import _symmetric_memory

    registered = []
    monkeypatch.setattr(_symmetric_memory, "enable_symm_mem_for_group", registered.append)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    name = enable_async_tp(mesh["tp"], torch.device("cuda", 0))
    assert registered == [mesh["tp"].get_group().group_name] == [name]
    with pytest.raises(AsyncTPError):
        enable_async_tp(mesh["tp"], torch.device("cpu"))
    assert registered == [name]


@pytest.mark.parametrize("before", [False, True])
def test_the_inductor_pass_is_on_inside_and_the_previous_value_back_after(before):
    with inductor_config.patch(_micro_pipeline_tp=before):
        with micro_pipeline_tp():
            assert inductor_config._micro_pipeline_tp is True
        assert inductor_config._micro_pipeline_tp is before
        with pytest.raises(RuntimeError, match="boom"), micro_pipeline_tp():
            raise RuntimeError("boom")
        assert inductor_config._micro_pipeline_tp is before


def _wired_step(rank, world, plan):
    """One step of ``plan`` on CPU with the CUDA gate lifted and symmetric memory not
    registered (so the pass fuses nothing): whether the tp group was registered, which
    graphs inductor's micro-pipeline pass ran over (False: a forward, True: a backward,
    told by its tangent inputs), the flag after the step, the loss."""
    from torch._inductor.fx_passes import post_grad

    from autopar.runtime import api

    monkeypatch = pytest.MonkeyPatch()
    registered, passes = [], []
    monkeypatch.setattr(api, "check_async_tp", lambda device: None)
    monkeypatch.setattr(async_tp_module, "check_async_tp", lambda device: None)
    monkeypatch.setattr(torch.distributed._symmetric_memory, "enable_symm_mem_for_group", registered.append)
    original = post_grad.micro_pipeline_tp_pass

    def spy(graph):
        passes.append(any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes))
        return original(graph)

    monkeypatch.setattr(post_grad, "micro_pipeline_tp_pass", spy)
    inductor_config.force_disable_caches = True  # a cached graph skips the post-grad passes
    job = parallelize(build("gpt"), plan, loss_fn=token_loss, measure_memory=False)
    (batch,) = job.shard(batches("gpt", 1, plan.config.global_batch_size))
    loss = job.step(batch)
    tp_group = job.mesh["tp"].get_group().group_name
    return registered == [tp_group], sorted(set(passes)), inductor_config._micro_pipeline_tp, loss


@pytest.mark.multiprocess
def test_the_steps_compile_with_the_pass_and_leave_it_off():
    """Both ranks register their tp group, inductor's pass runs over the compiled
    forward and backward graphs (one each at least), and the flag is off after the step."""
    for registered, passes, after, loss in run(_wired_step, 2, _async_tp_plan(), timeout_s=COMPILE_TIMEOUT_S):
        assert registered
        assert passes == [False, True]
        assert after is False
        assert math.isfinite(loss)


def test_a_dry_run_runs_synchronously_and_says_so():
    report = dry_run(lambda: build("gpt", "meta"), _async_tp_plan(), ranks=[0, 1])
    assert report.ok, report.problems
    assert report.synchronous_tp and report.eager_blocks
    assert "async TP was not exercised" in report.to_text()
    plain = dry_run(lambda: build("gpt", "meta"), make_plan("gpt", tp=2, sequence_parallel=True, compile=True))
    assert not plain.synchronous_tp and "async TP" not in plain.to_text()
