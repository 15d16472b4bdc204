"""A plan applied to another model is refused in the same words wherever it is given:
the runtime (``autopar.runtime.api.analyse``, before any process group) and the exports
name both models, their parameter counts and fingerprints, and differ only in advice."""

import pytest

import autopar
from autopar.export.common import ExportError
from autopar.export.shape import check_plans_model
from autopar.graph.units import model_fingerprint
from autopar.models import GPT, GPTConfig
from autopar.present.units import count
from autopar.runtime.api import analyse
from autopar.runtime.errors import PlanMismatchError


def _gpt(dim: int) -> GPT:
    return GPT(GPTConfig(vocab_size=256, seq_len=32, dim=dim, n_layers=2, n_heads=2))


def test_another_model_is_refused_alike_by_the_runtime_and_the_exports():
    planned, other = _gpt(32), _gpt(64)
    plan = autopar.plan(planned, "local-cpu:1", global_batch_size=2, seq_len=32)
    analyse(planned, plan)  # the model planned is accepted
    check_plans_model(planned, plan)
    with pytest.raises(PlanMismatchError) as runtime:
        analyse(other, plan)
    with pytest.raises(ExportError) as export:
        check_plans_model(other, plan)
    numel = sum(p.numel() for p in other.parameters())
    same = (
        f"the model given (GPT, {count(numel)} parameters, fingerprint {model_fingerprint(other)}) is not the one "
        f"the plan was made for (GPT, {count(plan.model.num_params)} parameters, fingerprint "
        f"{model_fingerprint(planned)}): their parameter names or shapes differ; "
    )
    assert str(runtime.value) == same + "make a plan for this model, or pass the plan's."
    assert str(export.value) == same + "pass the plan's model, or none."
    assert count(numel) != count(plan.model.num_params)
