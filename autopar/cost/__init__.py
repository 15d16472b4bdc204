"""The cost model: pure functions of numbers, and nothing else prices.

``price(model, decided)`` is the entry point: a :class:`CostModel` (the model's layer
graph, the cluster, the optimizer, the batch, a profile's corrections) and a fully
:class:`Decided` configuration in, the :class:`~autopar.plan.Prediction` out. The search
(:mod:`autopar.search`) asks the modules below for the numbers it decides on and never
computes a cost itself:

- ``compute``, ``comm``: the roofline and the collectives (alpha-beta, hierarchical);
- ``leaf``, ``tensor_parallel``: a unit under a tensor-parallel layout (``fp8``: its
  linear layers in FP8);
- ``recompute``: that layout under a recompute mode;
- ``memory``, ``peak``: model states by ZeRO stage, a rank's peak;
- ``pipeline``, ``stage``: schedules, bubbles, point-to-point, the schedule's buffers;
- ``data_parallel``: exposed data-parallel communication and the optimizer step;
- ``host``: every cost of the framework on the host that GPUs hide (CPU processes);
- ``step``: a step's time and the prediction.
"""

from autopar.cost.model import CostModel
from autopar.cost.price import Decided, UnitChoice, price

__all__ = ["CostModel", "Decided", "UnitChoice", "price"]
