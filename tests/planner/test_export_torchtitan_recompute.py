"""Recomputation exported to torchtitan: its activation checkpointing per block, every
N-th block, or per operator, counted on the ranks torchtitan builds the blocks on."""

import tomllib

from autopar.export import export
from autopar.vocab import Recompute, Schedule

from .test_export import torchtitan_config, variant


def test_torchtitan_activation_checkpoint(pipelined_plan):
    ac = torchtitan_config(variant(pipelined_plan, recompute=Recompute.FULL))["activation_checkpoint"]
    assert ac == {"mode": "full"}
    assert torchtitan_config(pipelined_plan)["activation_checkpoint"] == {"mode": "none"}
    half = {f"layers.{i}": Recompute.FULL for i in range(0, 40, 2)}
    result = export(variant(pipelined_plan, overrides=half), to="torchtitan")
    assert tomllib.loads(result.text)["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "2"}
    assert any("every N-th block" in n for n in result.notes)
    # torchtitan counts each process's blocks from 1 and checkpoints those N divides
    # (torchtitan 0.2 activation_checkpoint._layer_sac_count): by brute force, the
    # largest N that checkpoints at least each pipeline rank's recomputed blocks, the
    # partly recomputed ones counted in full
    pp = pipelined_plan.config.pp
    for full, op in ((15, 0), (10, 10), (1, 12), (3, 0), (2, 1)):
        modes = {f"layers.{i}": Recompute.FULL for i in range(full)}
        modes |= {f"layers.{i}": Recompute.OP for i in range(full, full + op)}
        plan = variant(pipelined_plan, overrides=modes)
        result = export(plan, to="torchtitan")
        every = int(tomllib.loads(result.text)["activation_checkpoint"]["selective_ac_option"])
        held = [[u for u in stage if u.startswith("layers.")] for stage in plan.stages]

        def enough(n: int) -> bool:
            for rank in range(pp):
                blocks = [u for stage in held[rank::pp] for u in stage]
                kept = [u for i, u in enumerate(blocks, start=1) if i % n == 0]
                if len(kept) < sum(u in modes for u in blocks):
                    return False
            return True

        assert every == max(n for n in range(1, 41) if enough(n)), (full, op)
        assert any("checkpointed in full" in n for n in result.notes) == (op > 0)
    selective = export(variant(pipelined_plan, recompute=Recompute.SELECTIVE), to="torchtitan")
    assert tomllib.loads(selective.text)["activation_checkpoint"]["selective_ac_option"] == "op"
    assert any("per operator" in n for n in selective.notes)
    op = export(variant(pipelined_plan, recompute=Recompute.OP), to="torchtitan")  # the same policy: no note
    assert tomllib.loads(op.text)["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert not any("per operator" in n or "no exact equivalent" in n for n in op.notes)


def test_torchtitan_activation_checkpoint_counts_a_v_schedules_ranks(pipelined_plan):
    """ZB-V places stages 0 and 3 of four on pipeline rank 0 (torchtitan's "v" stage ids):
    a plan recomputing those two stages' 20 blocks in full holds all 20 on rank 0, so
    torchtitan, which counts the blocks a process builds, must checkpoint every one
    (N = 1). Counting stages round robin put stages 0 and 2 on rank 0 and wrote N = 2,
    which checkpoints 10 of them: more memory than the plan predicts."""
    v = variant(pipelined_plan, schedule=Schedule.ZBV, virtual_stages=2)
    held = [[u for u in stage if u.startswith("layers.")] for stage in v.stages]
    recomputed = {u: Recompute.FULL for u in held[0] + held[3]}
    result = export(variant(v, schedule=Schedule.ZBV, virtual_stages=2, overrides=recomputed), to="torchtitan")
    assert len(recomputed) == 20
    assert tomllib.loads(result.text)["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "1"}
    assert any("wrote N = 1 (40 blocks" in n for n in result.notes), result.notes
