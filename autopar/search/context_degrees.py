"""Which context-parallel degrees the search tries: a ring over the sequence where torch's
ring attention can run the model's attention and each rank keeps enough tokens for the
key/value exchange to hide under the attention it feeds; and what a plan or a refusal
says of the degrees that floor leaves out, or of a fixed expert-parallel degree lifting it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from autopar.errors import ConfigError
from autopar.graph.layer_graph import LayerGraph
from autopar.search.experts import capacity_experts
from autopar.search.integers import divisors
from autopar.search.rejections import Rejection

if TYPE_CHECKING:
    from autopar.plan import ParallelConfig

CP_MIN_TOKENS = 4096
"""The search tries context parallelism only where each rank keeps at least this many
tokens of a sample: below it the key/value exchange of every layer can no longer hide
under the attention it feeds (whose work per rank grows with the tokens squared), and
the sequence is short enough for tensor and pipeline parallelism to hold. NVIDIA's NeMo
pretraining recipes for Llama 3 at 8,192 tokens keep 4K tokens per rank or fewer: cp=2
for 8B and 70B (``nemo/collections/llm/recipes/llama3_70b.py``: tp 4, pp 4, vp 5, cp 2),
cp=2 to 4 for 405B (``llama31_405b.py``); the floor takes the larger share. Llama 3's own
128K-token stage kept 8K per rank (Llama Team 2024, "The Llama 3 Herd of Models",
section 3.3.2). A ``cp`` constraint is always honoured."""


def cp_degrees(graph: LayerGraph, devices: int, constraints: Mapping[str, Any]) -> list[int]:
    """Context-parallel degrees to try on ``devices`` devices (those left after tensor
    parallelism): 1, and each divisor ``d`` that leaves every rank at least
    :data:`CP_MIN_TOKENS` tokens and splits the sequence into the ``2 d`` chunks of
    head-tail load balancing, for a model whose attention runs through
    ``F.scaled_dot_product_attention`` (the call torch's ring attention replaces),
    causal and without a mask (:attr:`~autopar.graph.layer_graph.LayerGraph.ring_attention`). A
    fixed ``ep > 1`` lifts the token floor: its expert groups must divide ``dp x cp``, which
    fixed degrees may reach only through ``cp``. A fixed ``cp`` is checked by
    :func:`check_context_parallel` and tried alone."""
    if "cp" in constraints:
        return [constraints["cp"]] if devices % constraints["cp"] == 0 else []
    if ring_blocker(graph):
        return [1]
    s = graph.seq_len
    fewest = 1 if constraints.get("ep", 1) > 1 else CP_MIN_TOKENS  # expert groups may need dp x cp
    return [1, *(d for d in ring_splits(s, devices) if s // d >= fewest)]


def ring_splits(seq_len: int, devices: int) -> list[int]:
    """The context-parallel degrees above 1 that divide ``devices`` and split a sequence of
    ``seq_len`` tokens into the ``2 d`` equal chunks of head-tail load balancing, in
    increasing order (whatever the tokens each rank keeps)."""
    return [d for d in divisors(devices) if d > 1 and seq_len % (2 * d) == 0]


def ring_blocker(graph: LayerGraph) -> str | None:
    """Why no context-parallel degree runs ``graph`` at its sequence length, if none does:
    torch's ring attention replaces ``F.scaled_dot_product_attention`` calls that are
    causal without a mask, over a sequence every rank can hold a part of."""
    if not any(p.kv_bytes > 0 for p in graph.profiles):
        return "context parallelism replaces F.scaled_dot_product_attention, which this model does not call"
    if not graph.ring_attention:
        return (
            "its attention is not causal without a mask (a sliding window, for which transformers passes a mask "
            "unless the window is wider than the sequence, or bidirectional attention), which the causal ring of "
            "context parallelism cannot compute"
        )
    if capacity_experts(graph):
        return (
            "its capacity-bounded experts fill each sample's buffers in token order over the whole sequence, which "
            "a rank holding a part of it cannot"
        )
    return None


def check_context_parallel(graph: LayerGraph, constraints: Mapping[str, Any], world: int) -> None:
    """A fixed ``cp > 1`` needs attention that ring attention runs (:func:`ring_blocker`)
    and a sequence that splits into ``2 cp`` equal chunks; said at once, in one line, with
    the degrees that would split it among those that divide the ``world`` devices."""
    cp = constraints.get("cp", 1)
    if cp == 1:
        return
    why = ring_blocker(graph)
    if why:
        masked = not graph.ring_attention and any(p.kv_bytes > 0 for p in graph.profiles)
        at = f" at seq_len={graph.seq_len}" if masked else ""  # a window is narrower than this sequence
        raise ConfigError(f"cp={cp} is not allowed for {graph.name}{at}: {why}; use cp=1.")
    if graph.seq_len % (2 * cp):
        allowed = ring_splits(graph.seq_len, world)[:8]
        other = f"a cp in {allowed} or " if allowed else "cp=1 or "  # an odd length splits for no cp > 1
        raise ConfigError(
            f"cp={cp} is not allowed with seq_len={graph.seq_len}: head-tail load balancing splits each "
            f"sequence into 2 x cp = {2 * cp} equal chunks; use {other}a sequence length divisible by {2 * cp}."
        )


def cp_left(c: Mapping[str, Any], world: int, seq_len: int) -> Rejection:
    """Why fixed ``dp``, ``tp`` and ``pp`` found no candidate: the context-parallel degree
    they leave is not one :func:`cp_degrees` tries for this model and sequence."""
    cp = world // (c["dp"] * c["tp"] * c["pp"])  # a whole number: check_degrees passed
    return Rejection(
        what=f"dp={c['dp']} tp={c['tp']} pp={c['pp']}",
        reason=f"they leave cp={cp} of the {world} devices, a degree the search does not try at seq_len={seq_len} "
        f"(it tries context parallelism where attention allows it and each rank keeps >= {CP_MIN_TOKENS} tokens); "
        f"set cp={cp} to plan with it, or change dp, tp or pp",
    )


def cp_below_floor(graph: LayerGraph, devices: int, constraints: Mapping[str, Any]) -> list[int]:
    """The context-parallel degrees :func:`cp_degrees` leaves out only for
    :data:`CP_MIN_TOKENS`: those dividing the ``devices`` the fixed ``dp``, ``tp`` and
    ``pp`` leave (the whole remainder where all three are fixed) that split the sequence
    into ``2 d`` chunks and that ring attention could run, none where ``cp`` is fixed or the
    sequence is shorter than the floor itself. A plan says it did not search them, so that
    a user may price one by fixing it."""
    if "cp" in constraints or graph.seq_len < CP_MIN_TOKENS or ring_blocker(graph) or constraints.get("ep", 1) > 1:
        return []  # a sequence shorter than the floor: tensor and pipeline parallelism hold it
    pinned = math.prod(constraints.get(k, 1) for k in ("dp", "tp", "pp"))
    if devices % pinned:
        return []
    left, s = devices // pinned, graph.seq_len
    fits = (lambda d: d == left) if "dp" in constraints and {"tp", "pp"} <= constraints.keys() else (lambda d: True)
    return [d for d in ring_splits(s, left) if fits(d) and s // d < CP_MIN_TOKENS]


def floor_lifted_note(config: ParallelConfig, seq_len: int, fixed: Mapping[str, Any]) -> str:
    """Where a fixed expert-parallel degree lifted the context-parallel token floor
    (:func:`cp_degrees`) and the plan splits its
    sequences below it, a note saying why."""
    if fixed.get("ep", 1) == 1 or config.cp == 1 or seq_len // config.cp >= CP_MIN_TOKENS:
        return ""
    return (
        f"cp={config.cp} leaves each rank {seq_len // config.cp:,} tokens of a sequence, below the "
        f"{CP_MIN_TOKENS:,} the search otherwise keeps: the fixed ep={fixed['ep']} needs expert groups inside "
        f"dp x cp, so every context-parallel degree was searched."
    )


def cp_floor_note(degrees: list[int], seq_len: int) -> str:
    """What a plan says of the context-parallel degrees its search left out for
    :data:`CP_MIN_TOKENS` (:func:`cp_below_floor`)."""
    shown = ", ".join(map(str, degrees[:4])) + (", ..." if len(degrees) > 4 else "")
    return (
        f"Context parallelism was searched only where each rank keeps at least {CP_MIN_TOKENS:,} tokens of a "
        f"sequence, as NVIDIA's Llama 3 recipes at 8K tokens do (below that, ring attention's key/value exchange hides "
        f"under less attention work); cp={shown} would also split these {seq_len:,} tokens: fix one "
        f"(constraints={{'cp': {degrees[0]}}}, --set cp={degrees[0]}) to price it."
    )
