"""Whether a model is the one a plan was made for: what the runtime, the dry run and
the exports check before they touch it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.graph.units import model_fingerprint
from autopar.present.units import count

if TYPE_CHECKING:
    from torch import nn

    from autopar.plan import ModelSummary


def model_problem(model: nn.Module, planned: ModelSummary) -> str:
    """How ``model`` differs from the model a plan was made for (``planned``): its
    parameter names or shapes (:func:`~autopar.graph.units.model_fingerprint`), said with
    both parameter counts; empty where it is that model. The runtime, the dry run and the
    exports refuse a plan for another model with it, each with its own advice."""
    found = model_fingerprint(model)
    if found == planned.fingerprint:
        return ""
    return (
        f"the model given ({type(model).__name__}, {count(sum(p.numel() for p in model.parameters()))} parameters, "
        f"fingerprint {found}) is not the one the plan was made for ({planned.name}, {count(planned.num_params)} "
        f"parameters, fingerprint {planned.fingerprint}): their parameter names or shapes differ"
    )
