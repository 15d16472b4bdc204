"""Model analysis: ``extract(model, ...)`` -> :class:`LayerGraph`."""

from autopar.graph.extract import extract, torch_dtype
from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT, Flow, LayerGraph, Leaf, LeafKind, Unit, UnitProfile
from autopar.graph.units import model_fingerprint

__all__ = [
    "UNIT_INPUT",
    "UNIT_OUTPUT",
    "Flow",
    "LayerGraph",
    "Leaf",
    "LeafKind",
    "Unit",
    "UnitProfile",
    "extract",
    "model_fingerprint",
    "torch_dtype",
]
