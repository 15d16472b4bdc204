"""A replicated leaf summed into the sequence-sharded residual stream: the runtime
slices it to its sequence shard, as the planner prices it (R -> Q at the unit's
output), or refuses the layout where it cannot (autopar.runtime.layouts)."""

from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT, Flow, Leaf, LeafKind, Unit, UnitProfile
from autopar.runtime.layouts import _resolve_unit, refusal
from autopar.vocab import Layout, TPStyle


def _unit(*, mlp_reads_residual: bool) -> UnitProfile:
    """norm -> proj (replicated attention's output) -> + residual -> fc (row) -> + residual."""
    leaves = tuple(
        Leaf(
            name=name,
            kind=kind,
            param_numel=64,
            weight_numel=64 if kind is LeafKind.LINEAR else 0,
            in_features=8,
            out_features=8,
            in_heads=0,
            out_heads=0,
            vocab=False,
            fwd_flops=1e6,
            matmul_flops=1e6 if kind is LeafKind.LINEAR else 0.0,
            fwd_bytes=1e4,
            saved_bytes=1e3,
        )
        for name, kind in (("norm", LeafKind.NORM), ("proj", LeafKind.LINEAR), ("fc", LeafKind.LINEAR))
    )
    edges = [(UNIT_INPUT, 0), (0, 1), (1, 2), (1, UNIT_OUTPUT), (2, UNIT_OUTPUT), (UNIT_INPUT, UNIT_OUTPUT)]
    if mlp_reads_residual:
        edges.append((UNIT_INPUT, 2))
    flows = tuple(
        Flow(
            src=s,
            dst=d,
            tensor_bytes=1e4,
            glue_flops=0.0,
            glue_bytes=0.0,
            saved_bytes=0.0,
            attn_flops=0.0,
            attn_bytes=0.0,
            attn_saved_bytes=0.0,
        )
        for s, d in edges
    )
    return UnitProfile(signature="residual", leaves=leaves, flows=flows, input_bytes=1e4, output_bytes=1e4)


STYLES = (TPStyle.REPLICATE, TPStyle.REPLICATE, TPStyle.ROW)


def test_a_replicated_addend_of_the_sequence_sharded_residual_runs():
    """proj's output reaches the MLP only through the residual sum: it is sliced to the
    sum's sequence shards (before the fix the check passed, and the add failed at run time
    on a whole tensor beside a sequence shard)."""
    prof = _unit(mlp_reads_residual=True)
    assert refusal(prof, STYLES, arrives=Layout.Q, boundary=Layout.Q, last=False, loss_parallel=False) is None
    unit = Unit(fqn="b", modules=("b",), prefix="b", profile=0, param_numel=0)
    styles = dict(zip(("b.norm", "b.proj", "b.fc"), STYLES, strict=True))
    out, leaves, _, _ = _resolve_unit(prof, unit, styles, Layout.Q, Layout.Q, last=False, loss_parallel=False)
    assert out is Layout.Q and leaves["b.proj"].output is Layout.Q and leaves["b.fc"].output is Layout.Q
    assert leaves["b.fc"].arrives is Layout.Q  # the sum, converted by the row style


def test_a_replicated_output_beside_the_sequence_sharded_residual_is_refused_by_name():
    """proj's whole output also feeds the MLP directly, so slicing it for the sum would
    not serve its other reader: the layout is refused, naming the residual stream."""
    prof = _unit(mlp_reads_residual=False)
    why = refusal(prof, STYLES, arrives=Layout.Q, boundary=Layout.Q, last=False, loss_parallel=False)
    assert why is not None and "residual stream of unit 'unit' is sequence-sharded" in why and "'proj' in R" in why
    assert "\n" not in why
    assert refusal(prof, STYLES, arrives=Layout.R, boundary=Layout.R, last=False, loss_parallel=False) is None
