"""A block whose input arrives in another layout converts it outside its checkpoint, so
the checkpoint keeps the converted tensor. GPT adds its learned position embedding
replicated; with sequence parallelism the first block cuts it into sequence shards. Run
on a fake two-rank process group in this process (collectives do nothing; shapes and
storages are real)."""

from parity import GPT_CFG, SEQ, batches, build, make_plan, megatron_styles, token_loss
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as wrapper_module

from autopar.runtime.api import parallelize


def test_every_checkpointed_block_keeps_a_sequence_shard_of_its_input(fake_world, monkeypatch):
    """Each fully recomputed block's checkpoint holds an input of ``mbs x SEQ/2 x dim``
    fp32 values in a storage of that size: the first block's included, whose input is
    the replicated sum of the two embeddings (before, it kept the whole sum, twice the
    bytes)."""
    plan = make_plan(
        "gpt",
        tp=2,
        sequence_parallel=True,
        recompute={f"layers.{i}": "full" for i in range(GPT_CFG.n_layers)},
        styles=megatron_styles("gpt", sequence_parallel=True),
    )
    kept: list[int] = []
    original = wrapper_module.CheckpointWrapper.forward

    def recording(self, *args, **kwargs):
        kept.append(args[0].untyped_storage().nbytes())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(wrapper_module.CheckpointWrapper, "forward", recording)
    job = parallelize(build("gpt"), plan, loss_fn=token_loss, measure_memory=False)
    first, second = job.shard(batches("gpt", 2, plan.config.global_batch_size))
    job.step(first)  # the first also infers the stage's shapes with a forward
    kept.clear()
    job.step(second)
    shard_bytes = plan.config.micro_batch_size * SEQ // 2 * GPT_CFG.dim * 4
    assert kept == [shard_bytes] * (GPT_CFG.n_layers * plan.config.num_microbatches)
