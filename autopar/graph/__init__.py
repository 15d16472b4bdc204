"""Model analysis: ``extract(model, ...)`` -> :class:`LayerGraph`."""

from autopar.graph.extract import extract, torch_dtype
from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT, Flow, LayerGraph, Leaf, LeafKind, Unit, UnitProfile
from autopar.graph.units import model_fingerprint

__all__ = ["extract", "torch_dtype", "LayerGraph", "Leaf", "LeafKind", "Flow", "Unit", "UnitProfile", "UNIT_INPUT",
           "UNIT_OUTPUT", "model_fingerprint"]
