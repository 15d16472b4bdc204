"""Compiled blocks and FP8 matmuls (``ParallelConfig.compile``, ``fp8``) in the exports:
torchtitan writes both as autopar runs them, Megatron-LM runs FP8 through Transformer
Engine, and the other frameworks are told what the plan assumed."""

from autopar.export import export

from .test_export import variant


def test_compiled_blocks_and_fp8_are_written_for_torchtitan_and_noted_for_the_others(gpt2_plan):
    """torchtitan compiles blocks and converts linears to float8 as autopar does; Megatron-LM
    runs FP8 through Transformer Engine (--fp8-format hybrid, with a note on its scaling);
    the other frameworks are told, in a note, what the plan assumed."""
    plan = variant(gpt2_plan, compile=True, fp8=True)
    titan = export(plan, to="torchtitan")
    assert '[compile]\nenable = true\ncomponents = ["model"]' in titan.text
    assert '[quantize.linear.float8]\nrecipe_name = "tensorwise"\nfilter_fqns = ["output"]' in titan.text
    assert 'converters = ["quantize.linear.float8"]' in titan.text
    for target, name in (("deepspeed", "DeepSpeed"), ("accelerate", "Accelerate")):
        (note,) = [n for n in export(plan, to=target).notes if "compiled blocks and FP8 matmuls" in n]
        assert f"are not written for {name}" in note
        assert not [n for n in export(gpt2_plan, to=target).notes if "FP8" in n]
    megatron = export(plan, to="megatron")
    assert "--fp8-format hybrid" in megatron.launch and "--fp8-format" not in export(gpt2_plan, to="megatron").launch
    (note,) = [n for n in megatron.notes if "compiled blocks" in n]
    assert note.startswith("the plan's compiled blocks are not written for Megatron-LM")
    assert [n for n in megatron.notes if n.startswith("the plan's FP8 matmuls are written as Transformer Engine's")]
