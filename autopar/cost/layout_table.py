"""The cost of every tensor-parallel layout of a unit at once.

The same terms as :func:`autopar.cost.tensor_parallel.evaluate_layout` (leaves, glue
per flow, a conversion once per producer and target layout, a partial-gradient
reduction once per producer, a vocabulary-parallel loss's reductions), priced for every
combination of the leaves' styles as arrays: a unit of a few leaves has a few thousand
layouts, which numpy prices in a millisecond, where an integer program takes tens.
:func:`evaluate_layout` stays the reference: the search re-prices the layout it picks
with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autopar.cost.layout_copies import conversion_copy_s, reduction_copy_s
from autopar.cost.leaf import (
    BACKWARD_FACTOR,
    TPContext,
    glue_layout,
    glue_step_s,
    leaf_accumulate_s,
    leaf_fwd_s,
    leaf_param_numel,
)
from autopar.cost.tensor_parallel import (
    consumers,
    conversion_s,
    loss_parallel_s,
    matmul_s,
    producer_bytes,
    reduction_s,
    reduction_transfer_s,
    transfer_s,
)
from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT, UnitProfile
from autopar.vocab import STYLE_IO, Layout, TPStyle

LAYOUTS = tuple(Layout)
_INDEX = {lay: i for i, lay in enumerate(LAYOUTS)}


@dataclass(frozen=True, kw_only=True)
class LayoutTable:
    """Every combination of styles: ``choice[c, i]`` indexes leaf ``i``'s options;
    ``time_s[c]`` is forward plus backward, compute plus communication, per micro-batch;
    ``param_numel[c]`` the parameters held; ``output[c]`` the index in :data:`LAYOUTS` of
    the unit's output layout as the runtime realises it."""

    choice: np.ndarray
    time_s: np.ndarray
    param_numel: np.ndarray
    output: np.ndarray


def layout_table(profile: UnitProfile, ctx: TPContext, options: Sequence[tuple[TPStyle, ...]]) -> LayoutTable:
    """The cost of every combination of ``options`` (one tuple of allowed styles per
    leaf) under ``ctx`` (module docstring)."""
    grids = np.meshgrid(*[np.arange(len(o)) for o in options], indexing="ij")
    choice = np.stack([g.ravel() for g in grids], axis=1) if options else np.zeros((1, 0), dtype=np.int64)
    count = choice.shape[0]
    time = np.zeros(count)
    params = np.zeros(count)
    produced, needed, column, row = {}, {}, {}, {}
    for i, opts in enumerate(options):
        leaf = profile.leaves[i]
        pick = choice[:, i]
        step = [(1 + BACKWARD_FACTOR) * leaf_fwd_s(leaf, s, ctx) + leaf_accumulate_s(leaf, s, ctx) for s in opts]
        time += np.asarray(step)[pick]
        params += np.asarray([leaf_param_numel(leaf, s, ctx.tp, ctx.ep) for s in opts])[pick]
        produced[i] = np.asarray([_INDEX[STYLE_IO[s][1]] for s in opts])[pick]
        needed[i] = np.asarray([_INDEX[STYLE_IO[s][0]] for s in opts])[pick]
        column[i] = np.asarray([s is TPStyle.COLUMN for s in opts])[pick]
        row[i] = np.asarray([s is TPStyle.ROW for s in opts])[pick]
    produced[UNIT_INPUT] = np.full(count, _INDEX[ctx.input_layout])
    outputs = ctx.output_layouts()
    if len(outputs) > 1:  # vocabulary-sharded exactly where a column-parallel leaf produces the output
        sharded = np.zeros(count, dtype=bool)
        for f in profile.flows:
            if f.dst == UNIT_OUTPUT and f.src != UNIT_INPUT:
                sharded |= column[f.src]
        needed[UNIT_OUTPUT] = np.where(sharded, _INDEX[Layout.F], _INDEX[Layout.R])
    else:
        needed[UNIT_OUTPUT] = np.full(count, _INDEX[outputs[0]])
    largest = producer_bytes(profile)
    wanted: dict[int, np.ndarray] = {}  # producer -> (combination, target layout) a conversion is owed
    partial: dict[int, np.ndarray] = {}
    for flow in profile.flows:
        a, need = produced[flow.src], needed[flow.dst]
        glue = np.array([[glue_step_s(flow, glue_layout(x, y), ctx) for y in LAYOUTS] for x in LAYOUTS])
        time += glue[a, need]
        owed = wanted.setdefault(flow.src, np.zeros((count, len(LAYOUTS)), dtype=bool))
        owed[np.arange(count), need] = True
        if flow.dst >= 0:
            partial[flow.src] = partial.get(flow.src, np.zeros(count, dtype=bool)) | column[flow.dst]
    hidden = _AsyncTP(profile, ctx, column, row, count) if ctx.async_tp else None
    for src, owed in wanted.items():
        nbytes = largest[src] * ctx.micro_batch
        conversion = np.array([[sum(conversion_s(x, y, nbytes, ctx)) for y in LAYOUTS] for x in LAYOUTS])
        time += (owed * conversion[produced[src]]).sum(axis=1)
        if hidden is not None:
            time -= hidden.conversions(src, nbytes, owed, produced[src])
    for src, reduced in partial.items():
        reduction = np.array([reduction_s(x, largest[src] * ctx.micro_batch, ctx) for x in LAYOUTS])
        time += np.where(reduced, reduction[produced[src]], 0.0)
        if hidden is not None:
            nbytes = largest[src] * ctx.micro_batch
            time -= np.where(reduced, hidden.reduction(src, nbytes, produced[src]), 0.0)
    if ctx.last:
        time += np.where(needed[UNIT_OUTPUT] == _INDEX[Layout.F], loss_parallel_s(ctx), 0.0)
    return LayoutTable(choice=choice, time_s=time, param_numel=params, output=needed[UNIT_OUTPUT])


class _AsyncTP:
    """What asynchronous TP hides of each combination's sequence-parallel collectives,
    as :func:`autopar.cost.tensor_parallel.evaluate_layout` prices it
    (:func:`autopar.cost.tensor_parallel.fused_hidden_s`)."""

    def __init__(self, profile: UnitProfile, ctx: TPContext, column: dict, row: dict, count: int):
        self.ctx = ctx
        self.row, self.row_mm = row, matmul_s(profile, ctx, TPStyle.ROW)
        column_mm = matmul_s(profile, ctx, TPStyle.COLUMN)
        self.under: dict[int, np.ndarray] = {}  # producer -> the column-parallel matmuls reading it
        self.readers: dict[int, np.ndarray] = {}  # producer -> how many column-parallel leaves read it
        for src, dsts in consumers(profile).items():
            self.under[src] = sum((np.where(column[d], column_mm[d], 0.0) for d in dsts), np.zeros(count))
            self.readers[src] = sum((column[d].astype(int) for d in dsts), np.zeros(count, dtype=int))

    def _hide(self, transfer: float, matmul: np.ndarray, removed_copy: float = 0.0) -> np.ndarray:
        k = (self.ctx.tp - 1) / self.ctx.tp
        return np.where(matmul > 0, removed_copy + np.minimum(transfer, matmul * k), 0.0)

    def conversions(self, src: int, nbytes: float, owed: np.ndarray, produced: np.ndarray) -> np.ndarray:
        """Hidden of the conversions of ``src``'s output owed in each combination: an
        all-gather (Q -> R) behind its column-parallel readers, a reduce-scatter (P -> Q)
        of a row-parallel output behind that matmul, and its backward all-gather too."""
        out = np.zeros(len(produced))
        if src in self.under:
            gather = transfer_s(Layout.Q, Layout.R, nbytes, self.ctx)[0]
            gathered = owed[:, _INDEX[Layout.R]] & (produced == _INDEX[Layout.Q])
            out += np.where(gathered, self._hide(gather, self.under[src]), 0.0)
        if src >= 0:
            f, bw = transfer_s(Layout.P, Layout.Q, nbytes, self.ctx)
            copy = conversion_copy_s(Layout.P, Layout.Q, nbytes, self.ctx)[0]
            scattered = owed[:, _INDEX[Layout.Q]] & (produced == _INDEX[Layout.P]) & self.row[src]
            mm = np.full(len(produced), self.row_mm[src])
            out += np.where(scattered, self._hide(f, mm, copy) + self._hide(bw, mm), 0.0)
        return out

    def reduction(self, src: int, nbytes: float, produced: np.ndarray) -> np.ndarray:
        """Hidden of the reduce-scatter of ``src``'s input gradient (``nbytes``) from its
        one column-parallel reader's input-gradient matmul (Q only)."""
        if src not in self.under:
            return np.zeros(len(produced))
        single = np.where(self.readers[src] == 1, self.under[src], 0.0)
        transfer, copy = reduction_transfer_s(Layout.Q, nbytes, self.ctx), reduction_copy_s(Layout.Q, nbytes, self.ctx)
        return np.where(produced == _INDEX[Layout.Q], self._hide(transfer, single, copy), 0.0)
