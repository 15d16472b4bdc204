"""The explanation's Memory line names where the peak is in the stage table's words."""

import re

import autopar
from autopar.hardware import preset
from autopar.models import GPT, GPTConfig


def _memory_and_table(plan) -> tuple[str, list[str]]:
    lines = autopar.explain(plan).splitlines()
    return next(x for x in lines if x.startswith("Memory")), [x for x in lines if "(rank " in x]


def test_the_memory_line_names_the_pipeline_rank_where_a_rank_holds_several_stages():
    """Interleaved 1F1B, 2 ranks x 2 stages: the peak is a rank's (its stages' memory
    together), and the line names that rank, whose rows in the stage table carry the
    same peak; stage indices would point at another row."""
    model = GPT(GPTConfig(vocab_size=512, seq_len=128, dim=128, n_layers=8, n_heads=4))
    cluster = preset("local-cpu", devices_per_node=2)
    fixed = {"pp": 2, "tp": 1, "schedule": "interleaved-1f1b", "virtual_stages": 2, "micro_batch_size": 1}
    plan = autopar.estimate(model, cluster, fixed, global_batch_size=4, seq_len=128)
    line, table = _memory_and_table(plan)
    rank = int(re.search(r"pipeline rank (\d+) \(", line).group(1))
    peak = max(plan.prediction.stages, key=lambda s: s.memory.total_bytes)
    assert rank == plan.config.rank_of_stage(peak.index)
    assert sum(f"(rank {rank})" in row for row in table) == 2  # both of its stages, in the table's words
    assert "stage " not in line.split(";")[1]


def test_the_memory_line_names_the_stage_where_each_rank_holds_one():
    model = GPT(GPTConfig(vocab_size=512, seq_len=128, dim=128, n_layers=8, n_heads=4))
    cluster = preset("local-cpu", devices_per_node=2)
    fixed = {"pp": 2, "tp": 1, "schedule": "1f1b", "micro_batch_size": 1}
    plan = autopar.estimate(model, cluster, fixed, global_batch_size=4, seq_len=128)
    line, _ = _memory_and_table(plan)
    peak = max(plan.prediction.stages, key=lambda s: s.memory.total_bytes)
    assert f"; stage {peak.index} (" in line
