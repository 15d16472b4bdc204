"""The explanation's Memory line names where the peak is in the stage table's words."""

import dataclasses
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


def test_the_stage_table_shows_the_stage_the_memory_line_names():
    """Past eight stages the table shows the first four and the last three: a peak on a
    middle stage (DeepSeek-V3's stage 26 of 32) was named by the Memory line and hidden
    by the table. The heaviest stage, here made stage 6 of 12, is always listed, with the
    hidden ones counted on either side of it."""
    model = GPT(GPTConfig(vocab_size=512, seq_len=128, dim=128, n_layers=12, n_heads=4))
    cluster = preset("local-cpu", devices_per_node=12)
    fixed = {"pp": 12, "tp": 1, "schedule": "1f1b", "micro_batch_size": 1}
    plan = autopar.estimate(model, cluster, fixed, global_batch_size=12, seq_len=128)
    p = plan.prediction
    heavy = dataclasses.replace(p.stages[6].memory, activations_bytes=p.stages[6].memory.activations_bytes + 2**30)
    stages = (*p.stages[:6], dataclasses.replace(p.stages[6], memory=heavy), *p.stages[7:])
    plan = dataclasses.replace(plan, prediction=dataclasses.replace(p, stages=stages))
    text = autopar.explain(plan)
    _, table = _memory_and_table(plan)
    assert [int(row.split("(rank")[0]) for row in table] == [0, 1, 2, 3, 6, 9, 10, 11]
    assert "  ... 2 more stages ...\n    6 (rank 6)" in text and "  ... 2 more stages ...\n    9 (rank 9)" in text
