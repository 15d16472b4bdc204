"""HSDP (``dp_shard``): FSDP2 on a (dp_replicate, dp_shard) mesh. Four ranks in two
replicate groups of two-rank shard groups train like one process, hold half of each
parameter, and communicate as the cost model prices it: per wrapped unit and
micro-batch, all-gathers and a reduce-scatter in the shard group and one all-reduce
across the replicate group."""

import pytest
from parity import assert_parity, build, make_plan, megatron_styles, reference, run, step_collectives, token_loss, train
from torch.distributed.tensor import Replicate, Shard

from autopar.runtime.api import parallelize
from autopar.runtime.recompute import clean_fqn

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("zero", [2, 3])
def test_hsdp_trains_like_one_process(zero):
    """dp=4 as 2 replicate groups x 2 shards, SGD with momentum and clipping: the same
    losses, gradient norms (each element counted once, not once per replicate group)
    and weights as one process; each rank keeps the momentum of its half of the model
    (the replicate groups each hold all of it)."""
    plan = make_plan("gpt", dp=4, zero_stage=zero, dp_shard=2)
    assert (plan.config.dp_shard, plan.config.replicate_size) == (2, 2)
    results = run(train, 4, "gpt", plan, 5, 0.5, None, None, 0.9)
    assert_parity(results, reference("gpt", plan, clip=0.5, momentum=0.9))
    total = sum(p.numel() for p in build("gpt").parameters())
    assert [r.extra["optimizer_state_numel"] for r in results] == [total // 2] * 4


def _process_group_call(func, args):
    """A process-group collective FSDP2 issues (a ``c10d`` op), one per call."""
    return func._opname if func.namespace == "c10d" else None


def _shards_and_collectives(rank, world, plan):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    shapes, placements, meshes = {}, set(), set()
    for stage in job.stages:
        for n, p in stage.named_parameters():
            shapes[clean_fqn(n)] = (tuple(p.to_local().shape), tuple(p.shape))
            placements.add(tuple(p.placements))
            meshes.add((p.device_mesh.mesh_dim_names, str(p.device_mesh.mesh.tolist())))
    return shapes, placements, meshes, step_collectives(job, plan, _process_group_call)


def test_hsdp_shards_over_the_shard_group_and_reduces_on_two_levels():
    """ZeRO-3 with m=2 micro-batches. Each rank holds half of dim 0 of every parameter,
    on the mesh [[0, 1], [2, 3]] (shard groups {0, 1} and {2, 3}). FSDP2 wraps 7 groups
    (4 blocks, the position embeddings, the norm, and the root holding the tied token
    embedding and head) and per micro-batch gathers each twice (forward, backward) and
    reduce-scatters it once, exactly as plain FSDP over all 4 ranks does; HSDP adds one
    all-reduce across the replicate group per reduce-scatter, and nothing else."""
    m, groups = 2, 7
    hsdp = run(_shards_and_collectives, 4, make_plan("gpt", dp=4, zero_stage=3, dp_shard=2, num_microbatches=m))
    plain = run(_shards_and_collectives, 4, make_plan("gpt", dp=4, zero_stage=3, num_microbatches=m))
    for rank, ((shapes, placements, meshes, counts), plain_rank) in enumerate(zip(hsdp, plain)):
        assert shapes and all(local[0] * 2 == full[0] and local[1:] == full[1:] for local, full in shapes.values())
        assert placements == {(Replicate(), Shard(0))}
        assert meshes == {(("dp_replicate", "dp_shard"), "[[0, 1], [2, 3]]")}
        assert counts["_allgather_base_"] == 2 * m * groups == plain_rank[3]["_allgather_base_"], rank
        assert counts["_reduce_scatter_base_"] == m * groups == plain_rank[3]["_reduce_scatter_base_"], rank
        assert counts["allreduce_"] == plain_rank[3]["allreduce_"] + m * groups, rank
        assert set(counts) == set(plain_rank[3])


def test_hsdp_over_tensor_parallelism_trains_like_one_process():
    """8 ranks: tp=2 (Megatron styles, consecutive ranks) inside shard groups of 2
    data-parallel ranks, 2 replicate groups; FSDP2 shards the TP-sharded weights further
    on the (dp_replicate, dp_shard, tp) mesh."""
    plan = make_plan("gpt", dp=4, tp=2, zero_stage=3, dp_shard=2, styles=megatron_styles("gpt"))
    assert_parity(run(train, 8, "gpt", plan, 5, 0.5, timeout_s=120), reference("gpt", plan, clip=0.5))


def test_a_dry_run_holds_the_shard_groups_half_of_the_model_as_predicted():
    """The measured dry run (fake process group, fake tensors) applies the HSDP plan: a
    rank holds half of every fp32 parameter, as the memory model predicts (divided by the
    shard group of 2, not by dp=4)."""
    from autopar.runtime.dry_run import dry_run

    plan = make_plan("gpt", dp=4, zero_stage=3, dp_shard=2)
    report = dry_run(lambda: build("gpt", "meta"), plan, measure=True)
    assert not report.problems
    (rank,) = report.ranks
    total = sum(p.numel() for p in build("gpt").parameters())
    assert rank.param_bytes == rank.predicted_param_bytes == 4 * total / 2


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_a_dry_run_says_when_predicted_params_count_gathered_copies(zero_stage):
    """ZeRO-2 keeps FSDP2's gathered parameters through the step, ZeRO-3 reshards them:
    in both a rank holds a quarter of every fp32 parameter between steps (dp=4), and the
    prediction adds, under ZeRO-2, the whole fp32 copy it gathers; the report says which
    the two columns count."""
    from autopar.runtime.dry_run import dry_run

    plan = make_plan("gpt", dp=4, zero_stage=zero_stage)
    report = dry_run(lambda: build("gpt", "meta"), plan)
    (rank,) = report.ranks
    total = sum(p.numel() for p in build("gpt").parameters())
    assert rank.param_bytes == 4 * total / 4
    assert rank.predicted_param_bytes == 4 * total / 4 + (4 * total if zero_stage == 2 else 0)
    assert report.gathered_params == (zero_stage == 2)
    assert ("predicted params add the gathered copies" in report.to_text()) == (zero_stage == 2)


def test_hsdp_under_pipelining_trains_like_one_process():
    """8 ranks: pp=2 over dp=4 in shard groups of 2; the tied embedding and head, on the
    first and last pipeline rank, are reduced between them shard by shard."""
    plan = make_plan("gpt", dp=4, pp=2, zero_stage=3, dp_shard=2)
    assert_parity(run(train, 8, "gpt", plan, 5, 0.5, timeout_s=120), reference("gpt", plan, clip=0.5))
