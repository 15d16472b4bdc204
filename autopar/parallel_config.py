"""How a job is split over devices: the parallel degrees, the batch split, the
pipeline schedule, sharding, recomputation and precision of a plan.

Plain frozen data, validated on construction so that a plan the runtime cannot run is
refused where it is made, in one line that names the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.errors import ConfigError
from autopar.vocab import ZERO_STAGES, DType, Recompute, Schedule

ONE_REPLICA_REDUCES_NOTHING = (
    "reduce_dtype='bf16' needs data parallelism (dp x cp > 1, got 1): it is the precision gradients are reduced in "
    "over the data-parallel ranks, and one replica reduces none; use reduce_dtype='fp32'."
)
"""The refusal of a bf16 reduction without data parallelism, before any other of its
requirements (no ZeRO stage would make it run)."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the job is split. ``dp * cp * tp * pp`` is the world size.

    Attributes:
        dp: data-parallel degree.
        tp: tensor-parallel degree (consecutive ranks; inside a node when possible).
        pp: pipeline-parallel degree (pipeline ranks).
        cp: context-parallel degree: each sample's sequence is split over ``cp`` ranks
            (the mesh axis next to tp), whose attention cores exchange keys and values
            in a ring (Liu et al. 2023, "Ring Attention"; torch's
            ``context_parallel``). They hold the same parameters, so gradients are
            reduced, and ZeRO state sharded, over the ``dp * cp`` ranks together
            (:attr:`dp_cp`), as torchtitan and Megatron-LM do; the batch is split over
            ``dp`` only.
        ep: expert-parallel degree: each mixture-of-experts layer's experts are split
            over ``ep`` ranks taken from the ``dp * cp`` ranks (torchtitan's and
            Megatron-LM's folding, :class:`autopar.vocab.MeshAxis`): a rank holds
            ``1 / ep`` of every expert layer, and tokens travel to their experts and
            back by all-to-all (Lepikhin et al. 2021, "GShard"). Expert gradients are
            reduced, and expert state sharded, over the ``dp * cp / ep`` ranks holding
            the same experts. ``ep`` does not change the world size.
        micro_batch_size: samples per micro-batch on one data-parallel rank.
        num_microbatches: micro-batches per step and data-parallel rank (gradient
            accumulation); the global batch is ``dp * micro_batch_size * num_microbatches``.
        schedule: pipeline schedule (ignored when ``pp == 1``).
        virtual_stages: stages per pipeline rank (> 1 only with ``interleaved-1f1b``,
            ``interleaved-zb``; exactly 2 with ``zbv`` and ``dualpipev``).
        zero_stage: 0-3, see :data:`autopar.vocab.ZERO_STAGES`.
        dp_shard: ranks of one FSDP shard group under hybrid sharding (HSDP): the ``dp``
            data-parallel ranks form ``dp / dp_shard`` replicate groups of ``dp_shard``
            consecutive data-parallel ranks (mesh axes ``dp_replicate`` x ``dp_shard``,
            :class:`autopar.vocab.MeshAxis`); ZeRO-2/3 state is sharded over the shard
            group and replicated across groups. ``None`` (the default) means ``dp``:
            one shard group, plain FSDP. With context parallelism a shard group also
            spans the ``cp`` ranks of its data-parallel ranks (:attr:`state_shards`).
            Only ZeRO-2/3 shard through FSDP2, so only they take a ``dp_shard`` below
            ``dp``.
        recompute: the default activation recomputation of every unit;
            ``Plan.layer_strategies.recompute`` lists the units that differ.
        sequence_parallel: norms and dropouts run on sequence shards of the TP group.
        dtype: training precision.
        compile: each block runs compiled (``torch.compile``, as torchtitan does): the
            element-wise ops between two matmuls or attention kernels run as one fused
            kernel, which reads what was written to memory before it and writes what a
            matmul, an attention kernel or the next block reads, where eager mode moves
            every intermediate tensor through memory.
        fp8: the linear layers of the blocks multiply in FP8 (torchao's float8
            training: inputs and weights cast to e4m3 and output gradients to e5m2 with
            one dynamic scale per tensor), at the device's FP8 tensor-core rate; weights,
            gradients, optimizer state and every other op stay in ``dtype``, which must
            be bf16. The embeddings, the head and mixture-of-experts stacks are not
            converted.
        async_tp: asynchronous tensor parallelism (torch's micro-pipeline TP, as
            torchtitan's ``enable_async_tensor_parallel``): the compiled blocks' sequence-
            parallel all-gathers and reduce-scatters run fused with the matmuls next to
            them, chunk by chunk, so the transfer of one chunk hides behind the matmul of
            another. Needs ``tp > 1``, ``sequence_parallel`` and ``compile``; the runtime
            runs it on CUDA devices (symmetric memory).
        regather: with sequence parallelism, a unit that keeps its activations
            (recompute ``none`` or ``selective``) keeps its rank's sequence shard of each
            input it all-gathers for column-parallel matmuls, and all-gathers it again in
            the backward, as Megatron-LM does, rather than holding the gathered copy
            (:mod:`autopar.runtime.regather`): ``1 / tp`` of those activations for one
            more all-gather each in the backward. Needs ``sequence_parallel`` and eager
            blocks (``compile=False``): the runtime does it with saved-tensor hooks.
        reduce_dtype: the precision FSDP2 reduces gradients in, and accumulates them in
            over a pipeline's micro-batches (its ``MixedPrecisionPolicy.reduce_dtype``):
            ``fp32`` (the default), or ``bf16`` with ``dtype='bf16'``, which halves the
            bytes of the reduce-scatter and of the unsharded gradients a pipeline stage
            holds until its last micro-batch, as Megatron-LM's ``--grad-reduce-in-bf16``
            does. The sharded gradient the optimizer reads stays fp32. Needs ZeRO-2/3
            (FSDP2's ``fully_shard``) and ``dp * cp > 1``; it trades the sum's precision
            (8 mantissa bits) for memory and bandwidth, so the search never picks it by
            itself.
    """

    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    micro_batch_size: int
    num_microbatches: int
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    zero_stage: int = 0
    dp_shard: int | None = None
    recompute: Recompute = Recompute.NONE
    sequence_parallel: bool = False
    dtype: DType = DType.BF16
    compile: bool = False
    fp8: bool = False
    async_tp: bool = False
    regather: bool = False
    reduce_dtype: DType = DType.FP32

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch_size", "num_microbatches", "virtual_stages"):
            value = getattr(self, name)
            if (type(value) is not int and (isinstance(value, bool) or not isinstance(value, int))) or value < 1:
                raise ConfigError(f"{name}={value!r} is not allowed: it must be a positive integer.")
        object.__setattr__(self, "schedule", enum_value(Schedule, self.schedule, "schedule"))
        object.__setattr__(self, "recompute", enum_value(Recompute, self.recompute, "recompute"))
        object.__setattr__(self, "dtype", enum_value(DType, self.dtype, "dtype"))
        object.__setattr__(self, "reduce_dtype", enum_value(DType, self.reduce_dtype, "reduce_dtype"))
        if (
            isinstance(self.zero_stage, bool)
            or not isinstance(self.zero_stage, int)
            or self.zero_stage not in ZERO_STAGES
        ):
            raise ConfigError(
                f"zero_stage={self.zero_stage!r} is not allowed: use 0 (DDP), 1 (sharded optimizer state), "
                f"2 (+ sharded gradients) or 3 (+ sharded parameters)."
            )
        self._check_dp_shard()
        self._check_ep()
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"sequence_parallel={self.sequence_parallel!r} is not allowed: use True or False.")
        for name in ("compile", "fp8", "async_tp", "regather"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} is not allowed: use True or False.")
        if self.async_tp and not (self.tp > 1 and self.sequence_parallel and self.compile):
            raise ConfigError(
                f"async_tp=True needs tp > 1 with sequence_parallel=True and compile=True (got tp={self.tp}, "
                f"sequence_parallel={self.sequence_parallel}, compile={self.compile}): torch fuses the sequence-"
                f"parallel collectives into the compiled blocks' matmuls; set them, or async_tp=False."
            )
        if self.regather and not self.sequence_parallel:
            raise ConfigError(
                "regather=True needs sequence_parallel=True (got sequence_parallel=False): it keeps shards of the "
                "sequence-parallel gathers; set sequence_parallel=True, or regather=False."
            )
        if self.fp8 and self.dtype is not DType.BF16:
            raise ConfigError(
                f"fp8=True needs dtype='bf16' (got {self.dtype.value!r}): FP8 matmuls keep bf16 weights and "
                f"activations around them; set dtype='bf16' or fp8=False."
            )
        self._check_reduce_dtype()
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError(
                "sequence_parallel=True needs tp > 1: sequence parallelism shards norms over the "
                "tensor-parallel group. Set tp >= 2 or sequence_parallel=False."
            )
        sched, multi_stage = self.schedule.value, self.schedule.multi_stage
        if self.virtual_stages > 1 and not multi_stage:
            raise ConfigError(
                f"virtual_stages={self.virtual_stages} needs schedule 'interleaved-1f1b', 'interleaved-zb', "
                f"'zbv' or 'dualpipev' (got {sched!r}, which runs one stage per pipeline rank); use virtual_stages=1 "
                f"for {sched}."
            )
        if multi_stage and self.virtual_stages < 2:
            raise ConfigError(
                f"schedule={sched!r} needs virtual_stages >= 2 (stages per pipeline rank); "
                "use schedule='1f1b' for one stage per rank."
            )
        if self.schedule.v_shape and self.virtual_stages != 2:
            raise ConfigError(
                f"schedule={sched!r} runs exactly 2 stages per pipeline rank (a V), got virtual_stages="
                f"{self.virtual_stages}; use virtual_stages=2 or schedule='interleaved-zb'."
            )
        if multi_stage and self.pp < 2:
            raise ConfigError(f"schedule={sched!r} needs pp >= 2.")

    def rank_of_stage(self, index: int) -> int:
        """The pipeline rank that runs stage ``index`` (:meth:`Schedule.rank_of_stage`)."""
        return self.schedule.rank_of_stage(index, self.pp)

    def stages_of_rank(self, pipeline_rank: int) -> tuple[int, ...]:
        """Indices of the stages a pipeline rank runs, in pipeline order."""
        return self.schedule.stages_of_rank(pipeline_rank, self.pp, self.num_stages)

    def _check_dp_shard(self) -> None:
        """``dp_shard`` divides ``dp``, shards over at least 2 ranks, and needs ZeRO-2/3;
        ``dp_shard == dp`` is stored as ``None`` (the same plan, one spelling)."""
        s = self.dp_shard
        if s is None:
            return
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ConfigError(f"dp_shard={s!r} is not allowed: it must be a positive integer dividing dp={self.dp}.")
        if s == self.dp:
            object.__setattr__(self, "dp_shard", None)
            return
        if self.dp % s or s < 2:
            allowed = [d for d in range(2, self.dp + 1) if self.dp % d == 0]
            raise ConfigError(
                f"dp_shard={s} is not allowed with dp={self.dp}: the shard group must divide dp and hold at "
                f"least 2 ranks; use one of {allowed} (or dp_shard=None for plain FSDP)."
            )
        if self.zero_stage < 2:
            raise ConfigError(
                f"dp_shard={s} needs zero_stage 2 or 3 (got {self.zero_stage}): only FSDP2 shards over a shard "
                f"group; set zero_stage=2 or 3, or dp_shard=None."
            )

    def _check_reduce_dtype(self) -> None:
        """Gradients reduce in fp32, or in bf16 under bf16 training with ZeRO-2/3."""
        r = self.reduce_dtype
        if r is DType.FP32:
            return
        if r is not DType.BF16 or self.dtype is not DType.BF16:
            raise ConfigError(
                f"reduce_dtype={r.value!r} is not allowed with dtype={self.dtype.value!r}: gradients reduce in "
                f"'fp32', or in 'bf16' under dtype='bf16'; use reduce_dtype='fp32'."
            )
        if self.dp_cp == 1:  # first: no zero_stage would help
            raise ConfigError(ONE_REPLICA_REDUCES_NOTHING)
        if self.zero_stage < 2:
            raise ConfigError(
                f"reduce_dtype='bf16' needs zero_stage 2 or 3 (got {self.zero_stage}): FSDP2 reduces and accumulates "
                f"the gradients in bf16; set zero_stage=2 or 3, or reduce_dtype='fp32'."
            )

    def _check_ep(self) -> None:
        """``ep`` divides the ranks holding the same weights (``dp * cp``), and under
        HSDP the shard group (``state_shards``): an expert group never straddles two
        replicate groups, so expert state shards within one."""
        if self.ep == 1:
            return
        if self.dp_cp % self.ep:
            allowed = [d for d in range(1, self.dp_cp + 1) if self.dp_cp % d == 0]
            raise ConfigError(
                f"ep={self.ep} is not allowed with dp x cp = {self.dp} x {self.cp} = {self.dp_cp}: experts are split "
                f"over data- and context-parallel ranks, so ep must divide dp x cp; use one of {allowed}."
            )
        if self.dp_shard is not None and self.state_shards % self.ep:
            raise ConfigError(
                f"ep={self.ep} is not allowed with HSDP's shard group of {self.state_shards} ranks (dp_shard x cp): "
                f"an expert group must lie inside one shard group; use an ep dividing {self.state_shards}, or a "
                f"larger dp_shard."
            )

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts: ``dp * cp / ep`` (expert gradients are
        reduced over them)."""
        return self.dp_cp // self.ep

    @property
    def expert_state_shards(self) -> int:
        """Ranks ZeRO shards expert state over: :attr:`state_shards` / ``ep`` (the
        expert replicas within one shard group)."""
        return self.state_shards // self.ep

    @property
    def shard_size(self) -> int:
        """Ranks of one FSDP shard group: ``dp_shard``, or ``dp`` without HSDP."""
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters: the data-parallel ranks times the
        context-parallel ranks. Gradients are reduced over them (``dp`` without context
        parallelism)."""
        return self.dp * self.cp

    @property
    def state_shards(self) -> int:
        """Ranks ZeRO shards optimizer state, gradients and parameters over: the shard
        group times ``cp`` (FSDP2 shards over the data- and context-parallel ranks
        together, torchtitan's ``dp_shard_cp`` mesh)."""
        return self.shard_size * self.cp

    @property
    def replicate_size(self) -> int:
        """Replicate groups of HSDP (``dp / shard_size``; 1 without HSDP)."""
        return self.dp // self.shard_size

    @property
    def unit_family(self) -> tuple:
        """What a unit's options depend on besides the micro-batch size and the
        sharding: the tensor-, context- and expert-parallel degrees, compiled blocks,
        FP8 matmuls, asynchronous TP, sequence parallelism, kept gather shards and
        precision. The search's caches are keyed by it, so an axis added here reaches
        every one of them."""
        return (
            self.tp,
            self.cp,
            self.ep,
            self.compile,
            self.fp8,
            self.async_tp,
            self.sequence_parallel,
            self.regather,
            self.dtype,
        )

    @property
    def world_size(self) -> int:
        """Devices the plan runs on."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.dp * self.micro_batch_size * self.num_microbatches

    @property
    def num_stages(self) -> int:
        """Pipeline stages in total (pp x virtual_stages)."""
        return self.pp * self.virtual_stages

    def short(self) -> str:
        """Compact text: ``dp=8 tp=8 pp=16 mbs=1 m=12 1f1b zero=3 shard=4 recompute=full sp bf16``
        (``shard=`` only under HSDP, ``cp=`` and ``ep=`` after ``pp=`` only with context
        and expert parallelism, `` compiled``, `` fp8``, `` async-tp`` and `` regather`` at the
        end when blocks are compiled, multiply in FP8, overlap their tensor-parallel
        collectives and keep the shards of their sequence-parallel gathers, and
        `` reduce-bf16`` when gradients reduce in bf16)."""
        sched = self.schedule.value if self.pp > 1 else "no-pp"
        if self.virtual_stages > 1:
            sched += f"(v={self.virtual_stages})"
        sp = " sp" if self.sequence_parallel else ""
        hsdp = f" shard={self.dp_shard}" if self.dp_shard is not None else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (
            f"dp={self.dp} tp={self.tp} pp={self.pp}{cp}{ep} mbs={self.micro_batch_size} m={self.num_microbatches} "
            f"{sched} zero={self.zero_stage}{hsdp} recompute={self.recompute.value}{sp} {self.dtype.value}"
            f"{' compiled' if self.compile else ''}{' fp8' if self.fp8 else ''}{' async-tp' if self.async_tp else ''}"
            f"{' regather' if self.regather else ''}{' reduce-bf16' if self.reduce_dtype is DType.BF16 else ''}"
        )


def enum_value(cls: Any, value: Any, name: str) -> Any:
    """``value`` as a member of the enum ``cls``; ConfigError naming ``name`` and the
    allowed values otherwise."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ConfigError(f"{name}={value!r} is not allowed; use one of {allowed}.") from None
