"""Asynchronous tensor parallelism (``ParallelConfig.async_tp``) in the exports: torchtitan
turns on its own ``enable_async_tensor_parallel`` (read back by its config parser in
test_export_parsers.py), Megatron-LM gets ``--tp-comm-overlap`` with a note that its
overlap is another mechanism, and DeepSpeed and Accelerate say the plan assumed it."""

from autopar.export import export

from .test_export import variant


def _async_tp(plan):
    """``plan`` (tensor-parallel, sequence-parallel) with compiled blocks and async TP."""
    return variant(plan, compile=True, async_tp=True)


def test_torchtitan_writes_its_async_tensor_parallel_switch(pipelined_plan):
    assert "enable_async_tensor_parallel = true" in export(_async_tp(pipelined_plan), to="torchtitan").text
    assert "enable_async_tensor_parallel = false" in export(pipelined_plan, to="torchtitan").text
    notes = export(_async_tp(pipelined_plan), to="torchtitan").notes
    assert not [n for n in notes if "asynchronous tensor parallelism" in n]


def test_megatron_overlaps_with_transformer_engine_and_says_it_differs(pipelined_plan):
    exported = export(_async_tp(pipelined_plan), to="megatron")
    words = exported.launch.split()
    assert "--tp-comm-overlap" in words and "--sequence-parallel" in words
    (note,) = [n for n in exported.notes if "--tp-comm-overlap" in n]
    assert "Transformer Engine's userbuffers" in note and "different mechanism" in note
    assert f"# NOTE: {note}" in exported.text
    # the flag carries it over: the note of options not written names compiled blocks only
    (missing,) = [n for n in exported.notes if "are not written for Megatron-LM" in n]
    assert "compiled blocks" in missing and "asynchronous" not in missing
    plain = export(variant(pipelined_plan, compile=True), to="megatron")
    assert "--tp-comm-overlap" not in plain.launch.split() and not [n for n in plain.notes if "--tp-comm" in n]


def test_deepspeed_and_accelerate_note_the_plan_assumed_it(pipelined_plan):
    tp_only = variant(pipelined_plan, pp=1, dp=4)  # Accelerate runs no pipeline
    for target, name in (("deepspeed", "DeepSpeed"), ("accelerate", "Accelerate")):
        (note,) = [n for n in export(_async_tp(tp_only), to=target).notes if "asynchronous tensor parallelism" in n]
        assert note.startswith("the plan's compiled blocks and asynchronous tensor parallelism are not written")
        assert f"for {name}: its prediction assumes them" in note
        assert not [n for n in export(tp_only, to=target).notes if "asynchronous" in n]


def test_three_options_not_written_are_listed_in_one_note(pipelined_plan):
    plan = variant(pipelined_plan, compile=True, fp8=True, async_tp=True, dtype="bf16")
    notes = export(plan, to="deepspeed").notes
    assert [n for n in notes if "compiled blocks, FP8 matmuls and asynchronous tensor parallelism are not" in n]
