"""Device sweep: structure and physics (more work takes longer), never absolute speed."""

import time

import pytest
import torch

from profiler.attention import attention_step_flops, measure_attention
from profiler.device import DeviceSweep, profile_device
from profiler.errors import SettingsError
from profiler.machine import physical_memory_bytes
from profiler.timing import Repeats, time_call, time_calls

FAST = Repeats(warmup=1, repeats=3, min_repeats=3, budget_s=0.2)


def test_cpu_sweep_measures_curves_and_bandwidth():
    lines = []
    report = profile_device(
        device="cpu",
        sweep=DeviceSweep(matmul_sizes=(32, 256), dtypes=("fp32", "bf16"), array_bytes=(2**20, 2**24), repeats=FAST),
        progress=lines.append,
    )
    d = report.device
    assert report.measured == ("device",)
    assert (d.kind, d.threads, d.timer, d.memory_shared) == ("cpu", 1, "wall-clock", True)
    assert d.memory_bytes == physical_memory_bytes() > 0
    assert d.dtypes == ("bf16", "fp32")
    assert d.attention == ()  # a CPU prices attention by the flop counter, at no kernel rate
    for p in d.matmul:
        assert p.flops == 2.0 * p.m * p.n * p.k and p.time.repeats == 3 and p.achieved_flop_per_s > 0
    for dt in d.dtypes:
        small, large = (p for p in d.matmul if p.dtype == dt)
        assert large.time.median_s > small.time.median_s  # 512x the FLOPs
        assert [f for f, _ in d.curve(dt)] == [2.0 * 32**3, 2.0 * 256**3]
    assert {(b.kernel, b.moved_bytes / b.array_bytes) for b in d.bandwidth} == {("copy", 2.0), ("add", 3.0)}
    for kernel in ("copy", "add"):
        small, large = sorted((b for b in d.bandwidth if b.kernel == kernel), key=lambda b: b.array_bytes)
        assert large.time.median_s > small.time.median_s  # 16x the bytes
    largest = [b for b in d.bandwidth if b.array_bytes == 2**24]
    assert d.memory_bandwidth_bytes_per_s == max(b.achieved_bytes_per_s for b in largest)
    assert d.provenance.software["torch"] == torch.__version__
    assert len(lines) == 4 + 2 + 1 + 4 and lines[0].startswith("matmul fp32 32x32x32:")
    # framework overheads: positive and of the right order for eager PyTorch on a CPU
    assert 1e-7 < d.op_overhead_s < 1e-3 and 0 < d.tp_overhead_s < 0.1
    assert any(line.startswith("framework overhead:") for line in lines)
    # an AdamW step reads and writes the weight and both moments and reads the gradient:
    # at least 28 bytes per parameter, which no kernel streams faster than the sweep's best
    assert d.optimizer_s_per_param * max(b.achieved_bytes_per_s for b in d.bandwidth) >= 28 * 0.5
    assert any(line.startswith("AdamW step:") for line in lines)


def test_threads_are_restored():
    before = torch.get_num_threads()
    profile_device(
        device="cpu",
        threads=1,
        sweep=DeviceSweep(matmul_sizes=(16,), dtypes=("fp32",), array_bytes=(2**16,), repeats=FAST),
    )
    assert torch.get_num_threads() == before


def test_bad_settings_are_refused():
    with pytest.raises(SettingsError, match="fp8"):
        DeviceSweep(dtypes=("fp8",))
    with pytest.raises(SettingsError, match="array sizes"):
        DeviceSweep(array_bytes=(16,))
    with pytest.raises(SettingsError, match="threads=0"):
        profile_device(device="cpu", threads=0)
    with pytest.raises(SettingsError, match="not supported"):
        profile_device(device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(SettingsError, match="CUDA is not available"):
            profile_device(device="cuda")
    with pytest.raises(SettingsError, match="min_repeats"):
        Repeats(repeats=2, min_repeats=3)


def test_time_call_against_a_known_duration():
    calls = []

    def nap():
        calls.append(1)
        time.sleep(0.003)

    t = time_call(nap, device=torch.device("cpu"), settings=Repeats(warmup=2, repeats=4, min_repeats=4))
    assert t.repeats == 4 and len(calls) == 2 + 1 + 4
    assert t.min_s >= 0.003  # sleep never returns early


def test_time_calls_interleaves_their_samples():
    """After each call's warm-up and calibration, every round samples each call once, so
    a burst of load from elsewhere lands on one sample of each."""
    order = []

    def napper(name, seconds):
        def nap():
            order.append(name)
            time.sleep(seconds)

        return nap

    a, b = time_calls(
        [napper("a", 0.002), napper("b", 0.004)],
        device=torch.device("cpu"),
        settings=Repeats(warmup=2, repeats=4, min_repeats=4),
    )
    assert order == ["a"] * 3 + ["b"] * 3 + ["a", "b"] * 4
    assert a.repeats == b.repeats == 4 and a.min_s >= 0.002 and b.min_s >= 0.004


def test_time_call_repeats_tiny_work_inside_a_sample():
    calls = []
    t = time_call(
        lambda: calls.append(1),
        device=torch.device("cpu"),
        settings=Repeats(warmup=0, repeats=3, min_repeats=3, min_sample_s=1e-3),
    )
    assert len(calls) > 3 * 10  # each sample ran the call many times
    assert 0 < t.median_s < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sweep_uses_events():
    d = profile_device(sweep=DeviceSweep(matmul_sizes=(256, 2048), array_bytes=(2**22, 2**26), repeats=FAST)).device
    assert (d.kind, d.timer, d.memory_shared) == ("cuda", "cuda-events", False)
    assert "fp32" in d.dtypes and d.memory_bytes == torch.cuda.get_device_properties(0).total_memory
    assert d.peak_flop_per_s(d.dtypes[0]) > 0


def test_attention_flops_by_hand():
    """FlashAttention's convention: 4 b h s^2 d forward products, half under the causal
    mask, and a backward of 2.5x: 2 x 32 heads x 4096^2 x 128 x 2 x 3.5."""
    assert attention_step_flops(2, 32, 4096, 128) == 2 * 32 * 4096**2 * 128 * 2 * 3.5


def test_attention_sweep_times_forward_and_backward():
    """The sweep (run on a GPU by profile_device) on the CPU's kernel, tiny shapes: the
    batch keeps the tokens per call, the FLOPs are the hand formula's, each point is
    timed (no speed is asserted: on this CPU both shapes take about the same time)."""
    points = measure_attention(
        (32, 128), torch.bfloat16, "bf16", torch.device("cpu"), FAST, heads=2, head_dim=16, tokens=256
    )
    assert [(p.batch, p.seq_len) for p in points] == [(8, 32), (2, 128)]
    for p in points:
        assert p.flops == attention_step_flops(p.batch, 2, p.seq_len, 16) and p.time.repeats == 3
