"""What a compiled block moves through memory: the trace's model of ``torch.compile``.

Inductor (``torch.compile``'s backend) leaves matrix multiplies and attention kernels to
their libraries and fuses the element-wise ops and reductions around them into generated
kernels. A fused kernel reads each tensor it needs from memory once and writes only the
results something outside it reads; its intermediates stay in registers. So, per
segment (a compiled block, or what runs before or after the blocks):

- a matmul or attention kernel (:data:`~autopar.graph.flops.MATMUL_OPS`) moves what it
  moves in eager mode, and every tensor it reads must be in memory: the fused kernel
  that made one writes it;
- an element-wise op joins the kernel of the element-wise ops whose results it reads,
  unless a matmul or attention kernel ran since they did (the kernel finished before it;
  what it made is written then and read back). Joining several such kernels merges
  them; an op that reads no such result starts a kernel of its own;
- a kernel reads each tensor that is in memory (a matmul's result, a parameter, the
  segment's input, a written intermediate) once, whichever of its ops reads it;
- the segment's outputs are written.

Tensors autograd saves for the backward are not written on that account: what a
compiled block saves is :mod:`autopar.graph.compiled_saved`'s, from the record kept here
of which element-wise op made each tensor from which, and which tensors were written.
Parameters are not counted here: the cost model charges their reads once per call
(``Leaf.weight_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

Account = Callable[[float, int], None]
"""Where an op's bytes and kernels are charged, ``account(nbytes, kernels)``: the leaf or
glue op that ran it (for a written result, the one whose kernel made it). Merging two
kernels refunds what they both charged, with negative amounts."""


@dataclass
class _Pending:
    """A result of a fused kernel that nothing outside the kernel has read yet."""

    kernel: int
    nbytes: float
    account: Account
    epoch: int


@dataclass
class _Kernel:
    """A fused kernel: who started it, and each tensor it reads from memory with who was
    charged for the read."""

    account: Account
    reads: dict[int, tuple[float, Account]] = field(default_factory=dict)


@dataclass
class Fusion:
    """The fused kernels of one segment as its ops are recorded (module docstring)."""

    epoch: int = 0
    """Matmul and attention kernels recorded so far: a fused kernel cannot span one."""
    pending: dict[int, _Pending] = field(default_factory=dict)
    kernels: dict[int, _Kernel] = field(default_factory=dict)
    parent: dict[int, int] = field(default_factory=dict)
    sources: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Each result of an element-wise op: the tensors (storage keys) the op read."""
    never_recomputed: set[int] = field(default_factory=set)
    """Results the partitioner keeps rather than recompute: reductions' and random ops'
    (:mod:`autopar.graph.compiled_saved`)."""
    materialized: set[int] = field(default_factory=set)
    """Tensors a matmul or attention kernel reads, and the segment's outputs: in memory
    whatever inductor fuses (a later element-wise op may join the kernel that made one
    where this model writes it, as inductor reorders independent work)."""
    sizes: dict[int, float] = field(default_factory=dict)
    """Bytes of each tensor an element-wise op read: every one of ``sources``."""

    def library_kernel(
        self, inputs: list[tuple[int, float]], outputs: list[tuple[int, float]], account: Account
    ) -> None:
        """A matmul or attention kernel reads ``inputs`` and writes ``outputs`` (storage
        key, bytes; parameters left out): each pending input is written by its kernel
        first, and the kernel moves what it moves in eager mode."""
        self.write(key for key, _ in inputs)
        self.epoch += 1
        account(sum(b for _, b in inputs) + sum(b for _, b in outputs), 1)

    def write(self, keys: Iterable[int], *, materialized: bool = True) -> None:
        """The tensors of ``keys`` are read outside their kernels (a library kernel, the
        segment's output; ``materialized``, or a later element-wise kernel): charge their
        writes to what made them."""
        for key in keys:
            found = self.pending.pop(key, None)
            if found is not None:
                found.account(found.nbytes, 0)
            if materialized:
                self.materialized.add(key)

    def fused_op(
        self,
        inputs: list[tuple[int, float]],
        outputs: list[tuple[int, float]],
        account: Account,
        *,
        never_recomputed: frozenset[int] = frozenset(),
    ) -> None:
        """An element-wise op reads ``inputs`` and makes ``outputs`` (storage key,
        bytes; parameters left out): it joins (or starts) a kernel and is charged what
        the kernel reads for it from memory. Its outputs are charged to ``account`` when
        something outside the kernel reads them. ``never_recomputed``: the outputs a
        compiled backward does not recompute (a reduction's, a random op's)."""
        self.sizes.update(inputs)
        read = tuple(k for k, _ in inputs)
        for key, _ in outputs:
            if key in read:
                continue  # in place: the tensor stays what made it first
            self.sources[key] = read
            if key in never_recomputed:
                self.never_recomputed.add(key)
        joined = set()
        for key, _ in inputs:
            found = self.pending.get(key)
            if found is None:
                continue
            if found.epoch == self.epoch:
                joined.add(self._root(found.kernel))
            else:  # its kernel ended before a library kernel ran
                self.write([key], materialized=False)
        if joined:
            kernel = self._merge(joined)
        else:
            kernel = len(self.parent)
            self.parent[kernel] = kernel
            self.kernels[kernel] = _Kernel(account=account)
            account(0.0, 1)
        reads = self.kernels[kernel].reads
        for key, size in inputs:
            if key in self.pending or key in reads:
                continue  # computed inside the kernel, or read by it already
            reads[key] = (size, account)
            account(size, 0)
        for key, size in outputs:
            self.pending[key] = _Pending(kernel=kernel, nbytes=size, account=account, epoch=self.epoch)

    def _root(self, kernel: int) -> int:
        while self.parent[kernel] != kernel:
            kernel = self.parent[kernel]
        return kernel

    def _merge(self, kernels: set[int]) -> int:
        """One kernel of ``kernels``: the others' starts and the reads they share are
        refunded."""
        root, *rest = sorted(kernels)
        into = self.kernels[root]
        for other in rest:
            self.parent[other] = root
            merged = self.kernels.pop(other)
            merged.account(0.0, -1)
            for key, (size, account) in merged.reads.items():
                if key in into.reads:
                    account(-size, 0)
                else:
                    into.reads[key] = (size, account)
        return root
