"""Shared pieces of the runtime tests: tiny models, data, plans, the single-process
reference run and the parallel worker.

Every parity test compares a parallel run with an independent single-process run of
the same model (same seed), the same global batches and SGD, step by step.

Tolerances (fp32): a parallel run sums the same products in another order (partial
matmuls all-reduced over TP ranks, micro-batch gradients accumulated, data-parallel
averages), so each value may differ from the reference by a few units in the last
place of fp32 (eps = 1.2e-7). ``LOSS_ATOL``: 10 ulps at the losses' magnitude (~4,
ulp 4.8e-7). ``PARAM_ATOL``: 10 ulps at the largest parameters (~1, ulp 1.2e-7) after
five SGD steps, which add lr x gradient differences of the same order. SGD, not Adam:
Adam divides by the square root of tiny second moments and turns 1e-9 gradient noise
into 1e-4 parameter differences.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig, MLPConfig, MLPStack, MoEConfig, MoELlama
from autopar.models.registry import build_named_model
from autopar.runtime.api import parallelize
from autopar.runtime.recompute import clean_fqn
from autopar.runtime.spmd import SPMDSettings, run_spmd

LOSS_ATOL = 4.8e-6
PARAM_ATOL = 1.2e-6
GRAD_NORM_RTOL = 1e-5
"""The norm sums ~1e5 squared gradients; each differs by a few ulps between runs, and
the sum's rounding adds ~sqrt(n) ulps: far below 1e-5 relative."""
LR = 0.1
SEQ = 16
VOCAB = 64

GPT_CFG = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, dim=32, n_layers=4, n_heads=4)
ODD_VOCAB_CFG = dataclasses.replace(GPT_CFG, vocab_size=VOCAB + 3)
SIX_BLOCK_CFG = dataclasses.replace(GPT_CFG, n_layers=6)
LLAMA_CFG = LlamaConfig(vocab_size=VOCAB, seq_len=SEQ, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64)
MLP_CFG = MLPConfig(in_dim=16, dim=32, ffn_dim=64, n_layers=4, out_dim=8)
MOE_CFG = MoEConfig(
    vocab_size=VOCAB, seq_len=SEQ, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48, n_experts=4, top_k=2
)


def build(name: str, device: str = "cpu") -> nn.Module:
    """A tiny reference model with fixed initial values."""
    torch.manual_seed(0)
    with torch.device(device):
        if name == "gpt":
            return GPT(GPT_CFG)
        if name == "gpt-odd-vocab":
            return GPT(ODD_VOCAB_CFG)
        if name == "gpt-6-blocks":
            return GPT(SIX_BLOCK_CFG)
        if name == "llama":
            return Llama(LLAMA_CFG)
        if name == "moe":
            return MoELlama(MOE_CFG)
        if name == "mlp":
            return MLPStack(MLP_CFG)
        if name == "moe-tiny":  # the registry's 8 experts (top-2), run on SEQ-token samples
            return build_named_model(name, device)
    raise ValueError(name)


def token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token."""
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return F.mse_loss(output.float(), target)


LOSSES: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    "gpt": token_loss,
    "gpt-odd-vocab": token_loss,
    "gpt-6-blocks": token_loss,
    "llama": token_loss,
    "moe": token_loss,
    "moe-tiny": token_loss,
    "mlp": mse_loss,
}


def batches(name: str, steps: int, global_batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic global batches (inputs, targets)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if name == "mlp":
            out.append(
                (
                    torch.randn(global_batch, MLP_CFG.in_dim, generator=g),
                    torch.randn(global_batch, MLP_CFG.out_dim, generator=g),
                )
            )
        else:
            out.append(
                (
                    torch.randint(0, VOCAB, (global_batch, SEQ), generator=g),
                    torch.randint(0, VOCAB, (global_batch, SEQ), generator=g),
                )
            )
    return out


def megatron_styles(name: str, *, sequence_parallel: bool = False) -> dict[str, str]:
    """Megatron-LM's layout: q/k/v and the MLP's first layers column, the projections
    after them row, the embedding vocabulary-parallel, the head column (loss parallel);
    with sequence parallelism the norms run on sequence shards."""
    styles: dict[str, str] = {}
    if name == "mlp":
        for i in range(MLP_CFG.n_layers):
            styles.update({f"layers.{i}.fc1": "column", f"layers.{i}.fc2": "row"})
        return styles
    cfg = {"llama": LLAMA_CFG, "moe": MOE_CFG, "moe-tiny": MOE_CFG}.get(name, GPT_CFG)
    for i in range(cfg.n_layers):
        for leaf in ("attention.wq", "attention.wk", "attention.wv"):
            styles[f"layers.{i}.{leaf}"] = "column"
        styles[f"layers.{i}.attention.wo"] = "row"
        if name not in ("moe", "moe-tiny"):  # the experts and the router are replicated
            styles[f"layers.{i}.feed_forward.w1"] = "column"
            styles[f"layers.{i}.feed_forward.w2"] = "row"
        if name == "llama":
            styles[f"layers.{i}.feed_forward.w3"] = "column"
        if sequence_parallel:
            styles[f"layers.{i}.attention_norm"] = "sequence"
            styles[f"layers.{i}.ffn_norm"] = "sequence"
    styles["tok_embeddings"] = "vocab"
    styles["output"] = "column"
    if sequence_parallel:
        styles["norm"] = "sequence"
    return styles


def make_plan(
    name: str,
    *,
    styles: dict[str, str] | None = None,
    recompute: dict[str, str] | None = None,
    cluster: autopar.Cluster | None = None,
    **config: Any,
) -> autopar.Plan:
    """A plan from the planner's ``estimate`` for ``config`` (fp32 and eager unless given,
    on a GPU cluster too), with the per-layer decisions replaced by ``styles``/``recompute``
    when given."""
    model = build(name, "meta")
    config = {
        "dp": 1,
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "micro_batch_size": 2,
        "num_microbatches": 2,
        "dtype": "fp32",
        "compile": False,
        **config,
    }
    world = config["dp"] * config["cp"] * config["tp"] * config["pp"]
    cluster = cluster or autopar.preset("local-cpu", devices_per_node=world)
    gbs = config["dp"] * config["micro_batch_size"] * config["num_microbatches"]
    kwargs = {"sample_input": torch.zeros(1, MLP_CFG.in_dim, device="meta")} if name == "mlp" else {"seq_len": SEQ}
    plan = autopar.estimate(model, cluster, config, global_batch_size=gbs, **kwargs)
    strategies = plan.layer_strategies
    if styles is not None:
        strategies = dataclasses.replace(strategies, tp={k: autopar.TPStyle(v) for k, v in styles.items()})
    if recompute is not None:
        strategies = dataclasses.replace(strategies, recompute={k: autopar.Recompute(v) for k, v in recompute.items()})
    return dataclasses.replace(plan, layer_strategies=strategies)


def with_cp(plan: autopar.Plan, cp: int) -> autopar.Plan:
    """``plan`` with context-parallel degree ``cp`` on ``cp`` times the local-cpu devices:
    for a plan made by another helper, or one the planner would refuse (the runtime's own
    checks are under test). The runtime reads only the config and the per-layer decisions;
    the prediction stays the ``cp=1`` plan's."""
    if cp == 1:
        return plan
    world = plan.config.world_size * cp
    return dataclasses.replace(
        plan,
        config=dataclasses.replace(plan.config, cp=cp),
        cluster=autopar.preset("local-cpu", devices_per_node=world),
    )


def with_ep(plan: autopar.Plan, ep: int) -> autopar.Plan:
    """``plan`` with expert-parallel degree ``ep`` (folded into its ``dp x cp`` ranks, so
    the world size is unchanged): the runtime reads only the config; the prediction
    stays the ``ep=1`` plan's."""
    return dataclasses.replace(plan, config=dataclasses.replace(plan.config, ep=ep))


def full(t: torch.Tensor) -> torch.Tensor:
    """A tensor's global value (DTensors gathered)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One rank's (or the reference's) losses and parameters after the run."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    grad_norms: list[float] = dataclasses.field(default_factory=list)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def reference(
    name: str,
    plan: autopar.Plan,
    steps: int = 5,
    *,
    clip: float | None = None,
    model: nn.Module | None = None,
    momentum: float = 0.0,
) -> RunResult:
    """The single-process run: same model, data and SGD, the whole global batch."""
    m = model if model is not None else build(name)
    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=momentum)
    losses, norms = [], []
    for x, y in batches(name, steps, plan.config.global_batch_size):
        loss = LOSSES[name](m(x), y)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in m.named_parameters(remove_duplicate=False)}
    return RunResult(losses=losses, params=params, grad_norms=norms)


def train(
    rank: int,
    world: int,
    name: str,
    plan: autopar.Plan,
    steps: int = 5,
    clip: float | None = None,
    model_fn: Callable[[], nn.Module] | None = None,
    init_fn: Any = None,
    momentum: float = 0.0,
    seed: int = 0,
) -> RunResult:
    """The parallel run on one rank (a ``run_spmd`` worker)."""
    model = model_fn() if model_fn is not None else build(name)
    sample = torch.zeros(1, MLP_CFG.in_dim) if name == "mlp" else None
    job = parallelize(
        model, plan, loss_fn=LOSSES[name], init_fn=init_fn, seed=seed, sample_input=sample, measure_memory=False
    )
    opt = job.optimizer(torch.optim.SGD, lr=LR, momentum=momentum)
    losses, norms = [], []
    for batch in job.shard(batches(name, steps, plan.config.global_batch_size)):
        losses.append(job.step(batch))
        if clip is not None:
            norms.append(job.clip_grad_norm_(clip))
        opt.step()
        opt.zero_grad()
    state = sum(
        (t.to_local() if isinstance(t, DTensor) else t).numel()
        for o in opt.inner
        if o is not None
        for st in o.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    return RunResult(
        losses=losses,
        params=all_params(job),
        grad_norms=norms,
        extra={"optimizer_state_numel": state, "dtypes": {str(p.dtype) for p in job.parameters()}},
    )


def resumable(
    job: Any, opt: Any, name: str, path: str, resume: bool, steps: int, save_at: int | None
) -> tuple[list[float], int]:
    """Train ``job`` over the run's ``steps`` global batches, first loading the latest
    checkpoint under ``path`` when ``resume`` (the job skips the batches it consumed),
    and stop after saving at step ``save_at``; returns the losses and the start step."""
    start = job.load_checkpoint(path) if resume else 0
    losses = []
    for step, batch in enumerate(job.shard(batches(name, steps, job.plan.config.global_batch_size)), start=start):
        losses.append(job.step(batch))
        opt.step()
        opt.zero_grad()
        if step + 1 == save_at:
            job.save_checkpoint(path, step=step + 1)
            break
    return losses, start


def all_params(job: Any) -> dict[str, torch.Tensor]:
    """Global values of every parameter name this rank holds (tied names included)."""
    return {clean_fqn(n): full(p) for stage in job.stages for n, p in stage.named_parameters(remove_duplicate=False)}


PG_TIMEOUT_S = 30
"""The process-group timeout of every :func:`run`: a collective left waiting fails after it."""


def run(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 90) -> list[Any]:
    """``run_spmd`` with the test suite's time limits."""
    return run_spmd(fn, world, *args, settings=SPMDSettings(timeout_s=timeout_s, pg_timeout_s=PG_TIMEOUT_S))


def assert_parity(results: list[RunResult], ref: RunResult) -> None:
    """Every rank's losses (and gradient norms, when clipped) equal the reference's, and
    every parameter a rank holds equals the reference's parameter of the same name
    (tied names included)."""
    seen: set[str] = set()
    for rank, res in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(res.grad_norms),
            torch.tensor(ref.grad_norms),
            rtol=GRAD_NORM_RTOL,
            atol=0,
            msg=lambda m, r=rank: f"rank {r} gradient norms: {m}",
        )
        torch.testing.assert_close(
            torch.tensor(res.losses),
            torch.tensor(ref.losses),
            rtol=0,
            atol=LOSS_ATOL,
            msg=lambda m, r=rank: f"rank {r} losses: {m}",
        )
        for n, value in res.params.items():
            expected = ref.params[n]
            torch.testing.assert_close(
                value, expected, rtol=0, atol=PARAM_ATOL, msg=lambda m, r=rank, n=n: f"rank {r} parameter {n}: {m}"
            )
            seen.add(n)
    missing = set(ref.params) - seen
    assert not missing, f"no rank holds {sorted(missing)}"


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives run under it by ``key(func, args)`` (None: not counted).
    DTensor operations are passed on, so a collective DTensor issues inside its own op is
    counted once, as ``CommDebugMode`` counts it."""

    def __init__(self, key: Callable[[Any, tuple], Hashable | None]):
        super().__init__()
        self.key = key
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        found = self.key(func, args)
        if found is not None:
            self.counts[found] += 1
        return func(*args, **(kwargs or {}))


def step_collectives(job: Any, plan: autopar.Plan, key: Callable[[Any, tuple], Hashable | None]) -> dict:
    """The collectives of a job's second training step, counted by ``key``
    (:class:`CollectiveCounter`): the first also runs pipelining's shape inference."""
    counts = []
    for batch in job.shard(batches("gpt", 2, plan.config.global_batch_size)):
        with CollectiveCounter(key) as mode:
            job.step(batch)
        counts.append(dict(mode.counts))
    return counts[-1]
