"""The plan, its predicted cost and why it won, as text a person reads."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

from autopar.errors import ConfigError
from autopar.plan import ParallelConfig, Plan
from autopar.present.units import byte_unit, count, duration, per_second, size
from autopar.vocab import SPLIT_BACKWARD_EAGER, DType, Recompute


def _batch(samples: int, seq_len: int) -> str:
    """The global batch in samples, and tokens per sample for a sequence model (a model
    of one position per sample, such as an image model, has no tokens to count)."""
    return f"{samples} x {seq_len} tokens" if seq_len > 1 else f"{samples} samples"


def explain(plan: Plan, *, top: int = 5) -> str:
    """The plan, its predicted cost and why it won, as text a person reads."""
    if not isinstance(plan, Plan):
        raise ConfigError(f"explain() takes a Plan (autopar.plan(...) or Plan.load(path)), got {type(plan).__name__}.")
    c, p, m, cl = plan.config, plan.prediction, plan.model, plan.cluster
    b = p.breakdown
    megatron = plan.settings.megatron_kernels
    lines = [
        f"autopar {'plan' if plan.settings.searched else 'estimate'}: {m.name} ({count(m.num_params)} parameters) on "
        f"{cl.describe()}",
        f"  batch {_batch(m.global_batch_size, m.seq_len)}, {c.dtype.value}{' with FP8 matmuls' if c.fp8 else ''}, "
        f"{plan.settings.optimizer.value} optimizer"
        f"{f', {plan.settings.attention.value} attention' if m.has_attention else ''}",
        "",
        f"Configuration  dp={c.dp} x {_cp(c)}tp={c.tp} x pp={c.pp}{_ep(c)} ({_mesh(c)}), micro-batch {c.micro_batch_size} x "
        f"{c.num_microbatches} per step, {schedule_text(c)}, ZeRO-{c.zero_stage}, {_recompute(plan)}"
        f"{', sequence parallel' if c.sequence_parallel else ''}",
        f"Predicted      step {duration(p.step_time_s)} | {per_second(p.samples_per_s, 1)} samples/s | "
        f"{f'{per_second(p.tokens_per_s, 0)} tokens/s | ' if m.seq_len > 1 else ''}"
        f"{rate(p.tflops_per_device * 1e12)} per device | MFU {100 * p.mfu:.1f}% (HFU {100 * p.hfu:.1f}%)"
        f"{_fp8_peak(plan)}",
        f"Memory         {size(p.memory_bytes_per_device)} peak per device of "
        f"{size(p.memory_capacity_bytes)} ({'fits' if p.fits else 'DOES NOT FIT'}); {_worst_memory(plan)}",
        f"Step time      {_breakdown(p.step_time_s, b)}",
        *_context(plan),
        *_experts(plan),
        *_sharding(plan),
        *_option_line(plan, "compile", "Compiled", COMPILE_WAYS, always=True),
        *_option_line(plan, "fp8", "FP8 matmuls", MEGATRON_FP8_WAYS if megatron else FP8_WAYS, always=False),
        *_option_line(plan, "async_tp", "Async TP", ASYNC_TP_WAYS, always=False),
        *_option_line(plan, "regather", "SP gathers", REGATHER_WAYS, always=False),
        "",
        "Stages (pipeline rank: units | forward / backward per micro-batch | peak memory)",
    ]
    lines += _stage_lines(p.stages)
    tp = _tp_summary(plan)
    if tp:
        lines += ["", f"Tensor parallelism (tp={c.tp})", *[f"  {line}" for line in tp]]
    runners = [a for a in plan.alternatives if a.status == "runner-up"][:top]
    others = [a for a in plan.alternatives if a.status == "degrees"][:top]
    oom = [a for a in plan.alternatives if a.status == "out-of-memory"][:top]
    lines += [
        "",
        f"Why this plan ({plan.candidates_evaluated} configurations costed in {duration(plan.search_time_s)}; "
        f"the search is exact for its cost model over the space it searches)"
        if plan.settings.searched
        else f"The configuration as given, priced in {duration(plan.search_time_s)} (nothing searched)",
    ]
    if runners:
        lines.append("  runners-up:")
        for a in runners:
            lines.append(
                f"    {a.short():<78} {duration(a.step_time_s)}  +{100 * a.slower_by:.1f}%  "
                f"{size(a.memory_bytes_per_device)}"
            )
    if others:
        found = [a.reason.startswith("the fastest of its degrees found") for a in others]
        tail = "; 'best found': the search stopped before it settled that one" if any(found) else ""
        lines.append(f"  other degrees (the fastest of each mix the runners-up do not show{tail}):")
        for a, cut in zip(others, found):
            lines.append(
                f"    {a.short():<78} {duration(a.step_time_s)}  +{100 * a.slower_by:.1f}%  "
                f"{size(a.memory_bytes_per_device)}{'  (best found)' if cut else ''}"
            )
    if oom:
        lines.append("  rejected (out of memory):")
        for a in oom:
            lines.append(f"    {a.reason}")
    if plan.settings.profile_sources:
        lines += ["", "Measurements used:", *[f"  {s}" for s in plan.settings.profile_sources]]
    if plan.notes:
        lines += ["", "Notes:", *[f"  - {n}" for n in plan.notes]]
    return "\n".join(lines)


def _cp(c: ParallelConfig) -> str:
    return f"cp={c.cp} x " if c.cp > 1 else ""


def _ep(c: ParallelConfig) -> str:
    return f", ep={c.ep}" if c.ep > 1 else ""


def _mesh(c: ParallelConfig) -> str:
    cp = "cp, " if c.cp > 1 else ""
    ep = f"; ep groups of {c.ep} inside dp{' x cp' if c.cp > 1 else ''}" if c.ep > 1 else ""
    if c.dp_shard is None:
        return f"mesh pp, dp, {cp}tp{ep}"
    return f"mesh pp, dp_replicate={c.replicate_size}, dp_shard={c.dp_shard}, {cp}tp{ep}"


def _fp8_peak(plan: Plan) -> str:
    """Under FP8 matmuls, which peak MFU and HFU are of (the compute precision's, as
    torchtitan quotes them), and what they are of the FP8 peak: an FP8 plan's HFU may
    pass 100% of the bf16 peak, and reads as a fraction of neither alone."""
    c, p = plan.config, plan.prediction
    if not c.fp8:
        return ""
    share = plan.cluster.device.peak(c.dtype) / plan.cluster.device.roofline.fp8_flops
    return f" of the {c.dtype.value} peak; {100 * p.mfu * share:.1f}% ({100 * p.hfu * share:.1f}%) of the FP8 peak"


def _axis_line(plan: Plan, label: str, axis: str, used: str | None) -> list[str]:
    """The line of one parallel axis (``cp``, ``ep``): ``used`` says how the plan uses it
    (None where it does not), followed by the best runner-up on the other side of the
    choice, with the axis where the plan has none and the other way round; no line where
    the plan does not use it and no runner-up does."""
    degree = getattr(plan.config, axis)
    other = next(
        (
            a
            for a in sorted(plan.alternatives, key=lambda a: a.step_time_s)
            if a.status in ("runner-up", "degrees") and (getattr(a.config, axis) > 1) != (degree > 1)
        ),
        None,
    )
    if used is None and other is None:
        return []
    text = used or "none"
    if other is not None:
        text += (
            f"; best {'without' if degree > 1 else f'with {axis}={getattr(other.config, axis)}'}: "
            f"{other.short()} {duration(other.step_time_s)} (+{100 * other.slower_by:.1f}%)"
        )
    return [f"{label:<15}{text}"]


def _context(plan: Plan) -> list[str]:
    """How context parallelism splits each sample and what its exchange costs
    (:func:`_axis_line`)."""
    c, m, b = plan.config, plan.model, plan.prediction.breakdown
    used = None
    if c.cp > 1:
        used = (
            f"cp={c.cp}: each sample's {m.seq_len:,} tokens in {c.cp} shards of {m.seq_len // c.cp:,} (head-tail "
            f"balanced); ring attention's key/value exchange exposes {duration(b.cp_comm_s)} per step; gradients "
            f"reduced over dp x cp = {c.dp_cp} ranks"
        )
    return _axis_line(plan, "Context par.", "cp", used)


def _experts(plan: Plan) -> list[str]:
    """How expert parallelism splits the experts and what its all-to-alls cost
    (:func:`_axis_line`)."""
    c, b = plan.config, plan.prediction.breakdown
    used = None
    if c.ep > 1:
        used = (
            f"ep={c.ep}: each mixture-of-experts layer's experts split over {c.ep} of the {c.dp_cp} ranks holding "
            f"the same weights; 4 all-to-alls per layer and micro-batch expose {duration(b.ep_comm_s)} per step; "
            + (
                f"expert gradients reduced over the {c.expert_replicas} ranks holding the same experts"
                if c.expert_replicas > 1
                else "each rank's experts are its own (no gradient reduction for them)"
            )
        )
        if plan.settings.routing_imbalance != 1.0:
            used += f"; dropless experts priced at {plan.settings.routing_imbalance:g}x the mean rows"
    return _axis_line(plan, "Expert par.", "ep", used)


def _option_line(plan: Plan, option: str, label: str, ways: tuple[str, str, str, str], *, always: bool) -> list[str]:
    """How the plan sets an option (``option``: ``compile``, ``fp8``, ``async_tp`` or ``regather``, also the
    status of its priced contrast in ``plan.alternatives``), and what the other way would
    take, in time and memory per device (compiled blocks and kept shards save
    activations, FP8 adds its casts). ``ways``: the text of the option on, off, and the
    names of the other way when it is on and when it is off. Without ``always``, nothing
    where the option is off and was not priced (the device cannot use it)."""
    on, off, other_when_on, other_when_off = ways
    enabled = getattr(plan.config, option)
    if option == "compile" and plan.config.schedule.zero_bubble and plan.config.pp > 1:
        off += f", as {plan.config.schedule.value} needs them ({SPLIT_BACKWARD_EAGER})"
        on += f"; torch does not run them under {plan.config.schedule.value} ({SPLIT_BACKWARD_EAGER}): plan again"
    found = [a for a in plan.alternatives if a.status == option]
    if not (always or enabled or found):
        return []
    text = on if enabled else off
    for a in found:
        other = other_when_on if enabled else other_when_off
        text += f"; {other}: {duration(a.step_time_s)} ({100 * a.slower_by:+.1f}%), {size(a.memory_bytes_per_device)}"
        if option == "compile" and not enabled and a.slower_by < 0 and not plan.cluster.device.compiles:
            text += " (not searched: this device does not compile unasked; compile=True, --set compile=true, plans it)"
    return [f"{label:<15}{text}"]


COMPILE_WAYS = (
    "blocks compiled (torch.compile: element-wise ops fused between matmuls)",
    "blocks run eager",
    "this configuration eager",
    "this configuration compiled",
)
FP8_WAYS = (
    "blocks' linear layers in FP8 (torchao float8, tensorwise scales)",
    "off",
    "this configuration in bf16",
    "this configuration in FP8",
)
MEGATRON_FP8_WAYS = (
    "blocks' linear layers in FP8 (Transformer Engine's, inputs kept in FP8)",
    *FP8_WAYS[1:],
)
ASYNC_TP_WAYS = (
    "sequence-parallel collectives fused with their matmuls (torch's micro-pipeline TP)",
    "off",
    "this configuration synchronous",
    "this configuration asynchronous",
)
REGATHER_WAYS = (
    "shards kept, gathered again in the backward (Megatron-LM's sequence parallelism)",
    "gathered copies held for the backward",
    "this configuration holding them",
    "this configuration keeping shards",
)


def _sharding(plan: Plan) -> list[str]:
    """How ZeRO-2/3 shard over the data-parallel ranks and in what precision they reduce
    gradients, and what the other sharding (plain FSDP or HSDP) would cost, when the
    search priced it."""
    c = plan.config
    if c.zero_stage < 2 or c.dp_cp == 1:
        return []
    if c.dp_shard is None and c.cp > 1:
        text = f"ZeRO-{c.zero_stage} sharded over all {c.dp_cp} data- and context-parallel ranks (plain FSDP)"
    elif c.dp_shard is None:
        text = f"ZeRO-{c.zero_stage} sharded over all {c.dp} data-parallel ranks (plain FSDP)"
    else:
        group = f"{c.dp_shard} x cp {c.cp} = {c.state_shards}" if c.cp > 1 else f"{c.dp_shard}"
        text = (
            f"HSDP: ZeRO-{c.zero_stage} sharded over groups of {group} ranks, replicated across "
            f"{c.replicate_size} groups"
        )
    if c.reduce_dtype is not DType.FP32:
        text += f", gradients reduced in {c.reduce_dtype.value}"
    for a in plan.alternatives:
        if a.status == "sharding":
            other = "plain FSDP" if a.config.dp_shard is None else f"best HSDP (shard groups of {a.config.dp_shard})"
            text += (
                f"; {other}: {duration(a.step_time_s)} (+{100 * a.slower_by:.1f}%), {size(a.memory_bytes_per_device)}"
            )
    return [f"Data parallel  {text}"]


def schedule_text(c: ParallelConfig) -> str:
    """How the pipeline runs, in the words every rendering of a plan uses: ``no pipeline``,
    ``1f1b schedule``, ``interleaved-1f1b with 2 stages per rank``."""
    if c.pp == 1:
        return "no pipeline"
    if c.virtual_stages > 1:
        return f"{c.schedule.value} with {c.virtual_stages} stages per rank"
    return f"{c.schedule.value} schedule"


def _recompute(plan: Plan) -> str:
    """The recompute mode, and the modules that take another; where those outnumber the
    modules taking the default (no mode holds a majority), every mode's count, most first."""
    c = plan.config
    overrides = plan.layer_strategies.recompute
    text = f"recompute {c.recompute.value}"
    if overrides:
        counts = Counter(v.value for v in overrides.values())
        default = len(plan.model.units) - len(overrides)
        if default < len(overrides):
            counts[c.recompute.value] = default
            ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
            text = f"recompute mixed over {len(plan.model.units)} modules: " + ", ".join(
                f"{n} {mode}" for mode, n in ranked
            )
        else:
            text += " (" + ", ".join(f"{n} unit(s) {mode}" for mode, n in sorted(counts.items())) + ")"
    modes = {c.recompute, *plan.layer_strategies.recompute.values()}
    if Recompute.OP in modes:
        text += "; op keeps every other matmul's and the attention's outputs"
    return text


def _stage_lines(stages) -> list[str]:
    """One line per stage; past eight, the first four, the last three and the one with
    the most memory (the peak the Memory line names), the others counted between."""
    heaviest = max(stages, key=lambda st: st.memory.total_bytes).index
    keep = set(range(len(stages))) if len(stages) <= 8 else {0, 1, 2, 3, *range(len(stages) - 3, len(stages)), heaviest}
    lines, hidden = [], 0
    for s in stages:
        if s.index not in keep:
            hidden += 1
            continue
        if hidden:
            lines.append(f"  ... {hidden} more stage{'s' if hidden > 1 else ''} ...")
            hidden = 0
        lines.append(
            f"  {s.index:>3} (rank {s.pipeline_rank}): {compact(s.units)} | {duration(s.forward_s)} / "
            f"{duration(s.backward_s)} | {size(s.memory.total_bytes)}"
        )
    return lines


def _breakdown(total: float, b) -> str:
    return " | ".join(f"{name} {duration(v)} ({100 * v / total:.0f}%)" for name, v in b.shown())


def _worst_memory(plan: Plan) -> str:
    s = max(plan.prediction.stages, key=lambda st: st.memory.total_bytes)
    mb = s.memory
    parts = [
        ("params", mb.params_bytes),
        ("grads", mb.grads_bytes),
        ("optimizer", mb.optimizer_bytes),
        ("activations", mb.activations_bytes),
        ("transient", mb.transient_bytes),
        *([("pipeline buffers", mb.buffers_bytes)] if mb.buffers_bytes else []),
        ("reserve", mb.reserve_bytes),
    ]
    divisor, unit = byte_unit(mb.total_bytes)
    config = plan.config
    # a rank holding several stages holds their memory together: name the rank, as the
    # stage table's "(rank r)" does
    where = f"pipeline rank {config.rank_of_stage(s.index)}" if config.virtual_stages > 1 else f"stage {s.index}"
    headroom = plan.settings.memory_headroom_bytes
    asked = f" (of it {headroom / divisor:.1f} headroom asked for)" if headroom else ""
    return f"{where} ({unit}): " + " | ".join(f"{n} {v / divisor:.1f}" for n, v in parts) + asked


def rate(flops_per_s: float) -> str:
    """FLOP/s in TFLOP/s, or GFLOP/s below one TFLOP/s."""
    return f"{flops_per_s / 1e12:.1f} TFLOP/s" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:.1f} GFLOP/s"


def compact(names: tuple[str, ...] | list[str]) -> str:
    """``layers.0, layers.1, layers.2, norm`` -> ``layers.0-2, norm``."""
    out: list[str] = []
    run: list[tuple[str, int]] = []

    def flush() -> None:
        if not run:
            return
        prefix, first = run[0]
        last = run[-1][1]
        out.append(f"{prefix}{first}" if first == last else f"{prefix}{first}-{last}")
        run.clear()

    for name in names:
        match = re.fullmatch(r"(.*?)(\d+)", name)
        if match:
            prefix, num = match.group(1), int(match.group(2))
            if run and run[-1][0] == prefix and run[-1][1] + 1 == num:
                run.append((prefix, num))
                continue
            flush()
            run.append((prefix, num))
        else:
            flush()
            out.append(name)
    flush()
    return ", ".join(out)


def _tp_summary(plan: Plan) -> list[str]:
    """Each layer pattern's tensor-parallel styles; under tp > 1 with no layer split (a
    model too small for the split to pay), that every layer is replicated, which the
    degree alone would hide."""
    if plan.config.tp > 1 and not plan.layer_strategies.tp:
        return [f"no layer is split: every layer is replicated over the {plan.config.tp} tensor-parallel ranks"]
    by_pattern: dict[str, Counter] = defaultdict(Counter)
    for fqn, style in plan.layer_strategies.tp.items():
        pattern = re.sub(r"\.\d+\.", ".*.", fqn, count=1)
        by_pattern[pattern][style.value] += 1
    return [
        f"{pattern}: " + ", ".join(f"{s}" + (f" x{n}" if n > 1 else "") for s, n in counts.items())
        for pattern, counts in sorted(by_pattern.items())
    ]
