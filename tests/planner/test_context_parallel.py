"""Context parallelism in the vocabulary and the cost model: a ``cp`` axis that splits
each sequence, whose ranks hold the same weights and exchange keys and values."""

from __future__ import annotations

import pytest

from autopar.errors import ConfigError
from autopar.plan import ParallelConfig


def _config(**kw) -> ParallelConfig:
    base = dict(dp=2, tp=2, pp=2, micro_batch_size=1, num_microbatches=4)
    return ParallelConfig(**{**base, **kw})


def test_cp_multiplies_the_world_and_the_gradient_group_but_not_the_batch():
    c = _config(cp=4, zero_stage=3)
    assert c.world_size == 2 * 4 * 2 * 2
    assert c.dp_cp == 8 and c.state_shards == 8
    assert c.global_batch_size == 2 * 1 * 4
    assert "pp=2 cp=4 " in c.short()
    plain = _config(zero_stage=3)
    assert plain.dp_cp == 2 and plain.state_shards == 2 and "cp=" not in plain.short()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cp=0), "cp=0 is not allowed: it must be a positive integer"),
        (dict(cp=2.0), "cp=2.0 is not allowed"),
        (dict(cp=2, dp=4, zero_stage=3, dp_shard=2), "dp_shard=2 with cp=2 is not supported"),
    ],
)
def test_bad_context_parallel_degrees_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message) as info:
        _config(**kwargs)
    assert "\n" not in str(info.value)
