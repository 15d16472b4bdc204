"""A model built on the meta device is materialised shard by shard with the values a
seeded single-process model gets from the same init function."""

import pytest
import torch
from parity import GPT_CFG, assert_parity, build, make_plan, megatron_styles, reference, run, train
from torch import nn

from autopar.runtime.init import initialize, unit_seed

pytestmark = pytest.mark.multiprocess

SEED = 7


def gpt2_init(unit: nn.Module) -> None:
    """GPT-2's initialisation, one unit at a time: N(0, 0.02) matrices, residual
    projections scaled by 1/sqrt(2 L), zero biases, unit norm scales."""
    for name, p in unit.named_parameters():
        if p.dim() >= 2:
            scale = (2 * GPT_CFG.n_layers) ** -0.5 if name.endswith(("wo.weight", "w2.weight")) else 1.0
            nn.init.normal_(p, mean=0.0, std=0.02 * scale)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
        else:
            nn.init.ones_(p)


def _meta_gpt() -> nn.Module:
    return build("gpt", "meta")


@pytest.mark.parametrize(
    "config",
    [
        dict(dp=2, tp=2, zero_stage=3),  # FSDP2 shards on meta, then each rank fills its own shards
        dict(tp=2, pp=2),  # tied embedding and head initialised on different pipeline ranks
    ],
)
def test_meta_model_trains_like_the_seeded_reference(config):
    plan = make_plan("gpt", styles=megatron_styles("gpt"), **config)
    ref_model = initialize(_meta_gpt(), plan.model.units, gpt2_init, seed=SEED)
    assert abs(float(ref_model.layers["0"].attention.wq.weight.detach().std()) - 0.02) < 0.004  # gpt2_init ran
    assert ref_model.output.weight is ref_model.tok_embeddings.weight
    results = run(train, plan.config.world_size, "gpt", plan, 5, None, _meta_gpt, gpt2_init, 0.0, SEED)
    assert_parity(results, reference("gpt", plan, model=ref_model))


def test_unit_seeds_are_stable_and_distinct():
    assert unit_seed(0, "layers.0") == unit_seed(0, "layers.0")
    assert len({unit_seed(0, f"layers.{i}") for i in range(64)}) == 64
    assert unit_seed(0, "layers.0") != unit_seed(1, "layers.0")


def test_initialize_is_independent_of_global_rng():
    """The per-unit seeds decide the values, not whatever the global RNG was at."""
    torch.manual_seed(123)
    a = initialize(_meta_gpt(), ("tok_embeddings", "layers.0"), gpt2_init, seed=SEED)
    torch.manual_seed(456)
    b = initialize(_meta_gpt(), ("tok_embeddings", "layers.0"), gpt2_init, seed=SEED)
    assert torch.equal(a.layers["0"].attention.wq.weight, b.layers["0"].attention.wq.weight)
