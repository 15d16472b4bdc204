"""The cost of every tensor-parallel layout of a unit at once.

The same terms as :func:`autopar.cost.tensor_parallel.evaluate_layout` (leaves, glue
per flow, a conversion once per producer and target layout, a partial-gradient
reduction once per producer, a vocabulary-parallel loss's reductions), priced for every
combination of the leaves' styles as arrays: a unit of a few leaves has a few thousand
layouts, which numpy prices in a millisecond, where an integer program takes tens.
:func:`evaluate_layout` stays the reference: the search re-prices the layout it picks
with it.

The combinations and what each term reads of them (a :class:`LayoutGrid`) do not depend
on the context's rates, degree or micro-batch, so a search builds them once per unit
and input/output rule and prices them in every context it tries. A producer's terms
read only its own output layout, which layouts its readers need and which of them are
column-parallel: a handful of distinct cases however many combinations there are, so
they are priced per case and gathered.
"""

from __future__ import annotations

import math
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
from autopar.cost.loss import loss_parallel_s
from autopar.cost.tensor_parallel import (
    consumers,
    conversion_s,
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
_R, _Q, _P, _F = (_INDEX[lay] for lay in (Layout.R, Layout.Q, Layout.P, Layout.F))


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


@dataclass(frozen=True)
class _Cases:
    """A producer's distinct cases: ``produced`` (its output layout), ``owed`` (which
    layouts its readers need, one column per layout), ``reduced`` (a column-parallel
    reader returns a partial gradient), ``row`` (it is row-parallel), ``column`` (per
    reader in :func:`consumers` order, whether it is column-parallel); ``of[c]`` is
    combination ``c``'s case."""

    src: int
    produced: np.ndarray
    owed: np.ndarray
    reduced: np.ndarray
    row: np.ndarray
    column: tuple[np.ndarray, ...]
    of: np.ndarray


@dataclass(frozen=True, kw_only=True)
class LayoutGrid:
    """Every combination of ``options`` (one tuple of allowed styles per leaf) for one
    input layout and output rule, and what each cost term reads of it (module
    docstring)."""

    options: tuple[tuple[TPStyle, ...], ...]
    choice: np.ndarray
    output: np.ndarray
    flow_layouts: tuple[np.ndarray, ...]  # per flow: produced(src) * len(LAYOUTS) + needed(dst)
    converted: tuple[_Cases, ...]  # producers owing conversions, in flow order
    reduced: tuple[int, ...]  # producers with leaf readers, in flow order (indexes ``converted``)


def _combinations(sizes: Sequence[int]) -> np.ndarray:
    """Every combination of one index per choice of ``sizes`` options, a row each, the
    last choice varying fastest (``np.meshgrid(..., indexing="ij")`` raveled, without its
    limit of 64 choices: a unit of a hundred leaves, most with one option, had more)."""
    count = math.prod(sizes)
    index = np.arange(count)
    columns, stride = [], count
    for size in sizes:
        stride //= size
        columns.append((index // stride) % size)
    return np.stack(columns, axis=1).astype(np.int8) if sizes else np.zeros((1, 0), dtype=np.int8)


def layout_grid(
    profile: UnitProfile, options: Sequence[tuple[TPStyle, ...]], input_layout: Layout, outputs: Sequence[Layout]
) -> LayoutGrid:
    """The combinations of ``options`` when the unit's input arrives ``input_layout`` and
    its output may leave in ``outputs`` (vocabulary-sharded, ``F``, exactly where a
    column-parallel leaf produces it, when there are two)."""
    choice = _combinations([len(o) for o in options])
    count = choice.shape[0]
    produced, needed, column, row = {}, {}, {}, {}
    for i, opts in enumerate(options):
        pick = choice[:, i]
        produced[i] = np.asarray([_INDEX[STYLE_IO[s][1]] for s in opts], dtype=np.int8)[pick]
        needed[i] = np.asarray([_INDEX[STYLE_IO[s][0]] for s in opts], dtype=np.int8)[pick]
        column[i] = np.asarray([s is TPStyle.COLUMN for s in opts])[pick]
        row[i] = np.asarray([s is TPStyle.ROW for s in opts])[pick]
    produced[UNIT_INPUT] = np.full(count, _INDEX[input_layout], dtype=np.int8)
    row[UNIT_INPUT] = np.zeros(count, dtype=bool)
    if len(outputs) > 1:
        sharded = np.zeros(count, dtype=bool)
        for f in profile.flows:
            if f.dst == UNIT_OUTPUT and f.src != UNIT_INPUT:
                sharded |= column[f.src]
        needed[UNIT_OUTPUT] = np.where(sharded, _F, _R).astype(np.int8)
    else:
        needed[UNIT_OUTPUT] = np.full(count, _INDEX[outputs[0]], dtype=np.int8)
    flow_layouts, owed, partial = [], {}, {}
    for flow in profile.flows:
        a, need = produced[flow.src], needed[flow.dst]
        flow_layouts.append((a * len(LAYOUTS) + need).astype(np.intp))
        mask = owed.setdefault(flow.src, np.zeros((count, len(LAYOUTS)), dtype=bool))
        mask[np.arange(count), need] = True
        if flow.dst >= 0:
            partial[flow.src] = partial.get(flow.src, np.zeros(count, dtype=bool)) | column[flow.dst]
    readers = consumers(profile)
    converted = tuple(
        _cases(
            src,
            produced[src],
            mask,
            partial.get(src, np.zeros(count, dtype=bool)),
            row[src],
            [column[d] for d in readers.get(src, ())],
        )
        for src, mask in owed.items()
    )
    order = [c.src for c in converted]
    return LayoutGrid(
        options=tuple(options),
        choice=choice,
        output=needed[UNIT_OUTPUT],
        flow_layouts=tuple(flow_layouts),
        converted=converted,
        reduced=tuple(order.index(src) for src in partial),
    )


def _cases(src: int, produced, owed, reduced, row, column) -> _Cases:
    facts = np.column_stack([produced, owed, reduced, row, *column]).astype(np.int64)
    code = facts[:, 0]
    for j in range(1, facts.shape[1]):  # mixed radix, renumbered before it could overflow
        if code.max() >= 2**40:
            code = np.unique(code, return_inverse=True)[1].reshape(-1)
        code = code * len(LAYOUTS) + facts[:, j]
    _, first, of = np.unique(code, return_index=True, return_inverse=True)
    case = facts[first]
    width = len(LAYOUTS)
    return _Cases(
        src=src,
        produced=case[:, 0],
        owed=case[:, 1 : 1 + width].astype(bool),
        reduced=case[:, 1 + width].astype(bool),
        row=case[:, 2 + width].astype(bool),
        column=tuple(case[:, 3 + width + k].astype(bool) for k in range(len(column))),
        of=of.reshape(-1).astype(np.intp),
    )


def layout_table(grid: LayoutGrid, profile: UnitProfile, ctx: TPContext) -> LayoutTable:
    """The cost of every combination of ``grid`` under ``ctx`` (module docstring)."""
    time, params = np.zeros(1), np.zeros(1)
    for leaf, opts in zip(profile.leaves, grid.options):  # combinations in the grid's order: outer sums
        step = [(1 + BACKWARD_FACTOR) * leaf_fwd_s(leaf, s, ctx) + leaf_accumulate_s(leaf, s, ctx) for s in opts]
        time = (time[:, None] + np.asarray(step)[None, :]).ravel()
        held = [leaf_param_numel(leaf, s, ctx.tp, ctx.ep) for s in opts]
        params = (params[:, None] + np.asarray(held)[None, :]).ravel()
    for flow, layouts in zip(profile.flows, grid.flow_layouts):
        glue = np.array(
            [
                [glue_step_s(flow, glue_layout(x, y, head_broadcast=flow.head_broadcast), ctx) for y in LAYOUTS]
                for x in LAYOUTS
            ]
        )
        time += glue.ravel()[layouts]
    largest = producer_bytes(profile)
    hidden = _AsyncTP(profile, ctx) if ctx.async_tp else None
    for cases in grid.converted:
        nbytes = largest[cases.src] * ctx.micro_batch
        conversion = np.array([[sum(conversion_s(x, y, nbytes, ctx)) for y in LAYOUTS] for x in LAYOUTS])
        time += (cases.owed * conversion[cases.produced]).sum(axis=1)[cases.of]
        if hidden is not None:
            time -= hidden.conversions(cases, nbytes)[cases.of]
    for k in grid.reduced:
        cases = grid.converted[k]
        nbytes = largest[cases.src] * ctx.micro_batch
        reduction = np.array([reduction_s(x, nbytes, ctx) for x in LAYOUTS])
        time += np.where(cases.reduced, reduction[cases.produced], 0.0)[cases.of]
        if hidden is not None:
            time -= np.where(cases.reduced, hidden.reduction(cases, nbytes), 0.0)[cases.of]
    if ctx.last:
        time += np.where(grid.output == _F, loss_parallel_s(ctx), 0.0)
    return LayoutTable(choice=grid.choice, time_s=time, param_numel=params, output=grid.output)


class _AsyncTP:
    """What asynchronous TP hides of a producer's sequence-parallel collectives in each
    of its cases, as :func:`autopar.cost.tensor_parallel.evaluate_layout` prices it
    (:func:`autopar.cost.tensor_parallel.fused_hidden_s`)."""

    def __init__(self, profile: UnitProfile, ctx: TPContext):
        self.ctx = ctx
        self.readers = consumers(profile)
        self.row_mm = matmul_s(profile, ctx, TPStyle.ROW)
        self.column_mm = matmul_s(profile, ctx, TPStyle.COLUMN)

    def _under(self, cases: _Cases) -> np.ndarray:
        """The column-parallel matmuls reading the producer, per case."""
        dsts = self.readers[cases.src]
        zero = np.zeros(len(cases.produced))
        return sum((np.where(c, self.column_mm[d], 0.0) for d, c in zip(dsts, cases.column)), zero)

    def _hide(self, transfer: float, matmul: np.ndarray, removed_copy: float = 0.0) -> np.ndarray:
        k = (self.ctx.tp - 1) / self.ctx.tp
        return np.where(matmul > 0, removed_copy + np.minimum(transfer, matmul * k), 0.0)

    def conversions(self, cases: _Cases, nbytes: float) -> np.ndarray:
        """Hidden of the conversions owed in each case: an all-gather (Q -> R) behind its
        column-parallel readers, a reduce-scatter (P -> Q) of a row-parallel output
        behind that matmul, and its backward all-gather too."""
        out = np.zeros(len(cases.produced))
        if cases.src in self.readers:
            gather = transfer_s(Layout.Q, Layout.R, nbytes, self.ctx)[0]
            gathered = cases.owed[:, _R] & (cases.produced == _Q)
            out += np.where(gathered, self._hide(gather, self._under(cases)), 0.0)
        if cases.src >= 0:
            f, bw = transfer_s(Layout.P, Layout.Q, nbytes, self.ctx)
            copy = conversion_copy_s(Layout.P, Layout.Q, nbytes, self.ctx)[0]
            scattered = cases.owed[:, _Q] & (cases.produced == _P) & cases.row
            mm = np.full(len(cases.produced), self.row_mm[cases.src])
            out += np.where(scattered, self._hide(f, mm, copy) + self._hide(bw, mm), 0.0)
        return out

    def reduction(self, cases: _Cases, nbytes: float) -> np.ndarray:
        """Hidden of the reduce-scatter of the producer's input gradient (``nbytes``) from
        its one column-parallel reader's input-gradient matmul (Q only)."""
        if cases.src not in self.readers:
            return np.zeros(len(cases.produced))
        one = sum(c.astype(int) for c in cases.column) == 1
        single = np.where(one, self._under(cases), 0.0)
        transfer, copy = reduction_transfer_s(Layout.Q, nbytes, self.ctx), reduction_copy_s(Layout.Q, nbytes, self.ctx)
        return np.where(cases.produced == _Q, self._hide(transfer, single, copy), 0.0)
