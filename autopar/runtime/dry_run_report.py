"""What a dry run found, per rank and as a whole, and the report a person reads
(:func:`autopar.runtime.dry_run.dry_run` makes it)."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.runtime.dry_step import StepMemory


@dataclass(frozen=True, kw_only=True)
class RankReport:
    """What one rank would hold.

    Attributes:
        rank: global rank; ``coordinate``: its (pp, dp, cp, tp).
        stages: the pipeline stages it runs.
        param_bytes: bytes of the parameters it holds (measured on its shards).
        predicted_param_bytes: the plan's parameter bytes for this pipeline rank.
        predicted_peak_bytes: the plan's peak memory on this rank's pipeline rank (all
            terms; the plan's per-device figure is the largest of these).
        predicted_allocated_bytes: the plan's peak for this pipeline rank less the
            device's reserve: the tensor bytes a measured step is compared with.
        usable_bytes: the device's memory less that reserve: what the measured peak
            must stay within (0: not known).
        measured: the measured step (None without ``measure``).
    """

    rank: int
    coordinate: tuple[int, int, int, int]
    stages: tuple[int, ...]
    param_bytes: int
    predicted_param_bytes: float
    predicted_peak_bytes: float
    predicted_allocated_bytes: float = 0.0
    usable_bytes: float = 0.0
    measured: StepMemory | None = None

    @property
    def over_device(self) -> bool:
        """The measured peak does not fit the device (less its reserve)."""
        return self.measured is not None and 0 < self.usable_bytes < self.measured.peak_bytes

    @property
    def measured_over_predicted(self) -> float:
        """Measured peak tensor bytes over the predicted allocation (0 when not measured)."""
        if self.measured is None or self.predicted_allocated_bytes <= 0:
            return 0.0
        return self.measured.peak_bytes / self.predicted_allocated_bytes


@dataclass(frozen=True, kw_only=True)
class DryRunReport:
    """The outcome of :func:`dry_run`. ``eager_blocks``: the plan compiles its blocks,
    which the dry run ran eager. ``synchronous_tp``: the plan fuses its tensor-parallel
    collectives into those blocks' matmuls (``async_tp``), which the dry run did not.
    ``assumed_routing``: the routing imbalance the measured steps assumed for dropless
    experts under expert parallelism (1: balanced; fake tensors have no routing,
    :mod:`autopar.runtime.assumed_routing`), None where no such experts ran.
    ``added_ranks``: ranks a measured run ran besides those asked for, the first of each
    earlier pipeline rank, whose stages announce the inputs of the later ones.
    ``assumed_inputs``: stages whose input was assumed, unchecked: ``ranks`` left out their predecessors'.
    ``eager_peak_bytes``: for compiled blocks run eager, the plan's peak per device priced
    eager, where the plan carries that contrast (``Alternative`` of status ``compile``):
    what the eager step measured is like for like with it. ``eager_over_device``: ranks
    whose eager step exceeded the device: a note, not a problem, for a compiled plan,
    whose own step keeps less and cannot be measured here. ``gathered_params``: the
    predicted parameter bytes count the gathered copies the step holds
    (:func:`autopar.cost.memory.holds_gathered_params`), the held ones the shards alone."""

    plan: str
    world_size: int
    problems: tuple[str, ...]
    ranks: tuple[RankReport, ...]
    eager_blocks: bool = False
    synchronous_tp: bool = False
    assumed_routing: float | None = None
    eager_peak_bytes: float | None = None
    eager_over_device: tuple[int, ...] = ()
    gathered_params: bool = False
    added_ranks: tuple[int, ...] = ()
    assumed_inputs: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems

    def to_text(self) -> str:
        """A report a person reads."""
        lines = [
            f"dry run of {self.plan} on {self.world_size} ranks: "
            f"{'OK' if self.ok else f'{len(self.problems)} problem(s)'}"
        ]
        lines += [f"  problem: {p}" for p in self.problems]
        if self.added_ranks:
            ranks = ", ".join(map(str, self.added_ranks))
            lines.append(
                f"  note: rank{'s' * (len(self.added_ranks) > 1)} {ranks} ran too: a measured pipeline rank takes "
                f"the shape of its input from the stages before it, which only their ranks announce"
            )
        if self.assumed_inputs:
            lines.append(
                f"  note: the inputs of stages {list(self.assumed_inputs)} were assumed equal to an earlier stage "
                f"boundary and not checked (their predecessors' ranks were not run); leave --ranks out to check them"
            )
        if self.eager_blocks:
            like = (
                f"priced eager, the plan's peak is {gib(self.eager_peak_bytes)} per device"
                if self.eager_peak_bytes is not None
                else "make the plan with --set compile=false to check an eager plan by measurement"
            )
            lines.append(
                "  note: the plan compiles its blocks; the dry run runs them eager, keeping the intermediates "
                f"compiled blocks recompute (its peak may exceed the compiled prediction by those; {like})"
            )
        if self.eager_over_device:
            ranks = ", ".join(map(str, self.eager_over_device))
            lines.append(
                f"  note: the eager step of rank{'s' * (len(self.eager_over_device) > 1)} {ranks} exceeds the device: "
                f"run eager (compile=False) this configuration would not fit; the compiled step, which the plan "
                f"prices, cannot be measured here (compiling needs real tensors)"
            )
        if self.synchronous_tp:
            lines.append(
                "  note: async TP was not exercised: the dry run runs the tensor-parallel collectives synchronously "
                "(async_tp fuses them into compiled matmuls on CUDA only)"
            )
        if self.assumed_routing is not None:
            lines.append(f"  note: {_routing_note(self.assumed_routing)}")
        if self.ranks and self.gathered_params:
            lines.append(
                "  note: params held are the shards a rank keeps between steps; predicted params add the "
                "gathered copies the plan's ZeRO stage keeps through the step (in the measured peak)"
            )
        if self.ranks:
            lines.append("  rank  (pp,dp,cp,tp)  stages      params held   predicted params   predicted peak")
            for r in self.ranks:
                lines.append(
                    f"  {r.rank:<5} {r.coordinate!s:<14} {list(r.stages)!s:<11} "
                    f"{gib(r.param_bytes):>11}   {gib(r.predicted_param_bytes):>16}   "
                    f"{gib(r.predicted_peak_bytes):>14}"
                )
        measured = [r for r in self.ranks if r.measured is not None]
        if measured:
            lines.append(
                "  one step on fake tensors: tensor bytes at the peak against the plan's (its peak less the reserve)"
            )
            lines.append("  rank   measured peak   predicted       ratio   held after step   step time")
            for r in measured:
                m = r.measured
                lines.append(
                    f"  {r.rank:<6} {gib(m.peak_bytes):>13}   {gib(r.predicted_allocated_bytes):>13}   "
                    f"{r.measured_over_predicted:5.3f}   {gib(m.held_bytes):>15}   {m.seconds:7.1f} s"
                )
                if m.peak_phase_bytes:
                    parts = " | ".join(f"{phase} {gib(b)}" for phase, b in m.peak_phase_bytes.items() if b)
                    lines.append(f"         at the peak, by when allocated: {parts}")
        return "\n".join(lines)


def _routing_note(imbalance: float) -> str:
    if imbalance == 1.0:
        return (
            "dropless experts measured at balanced routing (each expert receives tokens x top_k / experts rows), "
            "as the plan prices them; a skewed router holds more"
        )
    return (
        f"dropless experts measured at the plan's routing imbalance (this rank receives {imbalance:g}x its "
        f"balanced rows), as the plan prices them"
    )


def gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"
